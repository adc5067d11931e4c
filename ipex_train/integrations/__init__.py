"""Integrations of :func:`ipex_train.optimize` with training frameworks.

Each lives in its own module and imports its framework only when that module is imported, so ``import
ipex_train`` never needs them:

* :mod:`ipex_train.integrations.accelerate`: HuggingFace Accelerate (``IpexTrainPlugin``).
* :mod:`ipex_train.integrations.transformers`: HuggingFace Transformers checkpoints keep the fp32 dtype (applied
  by optimize() itself), and ``Trainer``, the drop-in HF Trainer (:mod:`.hf_trainer`, loaded on first use).
* :mod:`ipex_train.integrations.lightning`: Lightning's precision plugin (``IpexTrainPrecision``).
* :mod:`ipex_train.integrations.peft`: adapters keep their low-precision storage through peft's adapter loading
  (applied by optimize() itself).
"""
