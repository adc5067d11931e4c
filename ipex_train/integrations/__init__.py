"""Integrations of :func:`ipex_train.optimize` with training frameworks.

Each lives in its own module and imports its framework only when that module is imported, so ``import
ipex_train`` never needs them:

* :mod:`ipex_train.integrations.accelerate`: HuggingFace Accelerate (``IpexTrainPlugin``).
* :mod:`ipex_train.integrations.transformers`: HuggingFace Transformers checkpoints keep the fp32 dtype (applied
  by optimize() itself).
* :mod:`ipex_train.integrations.peft`: adapters keep their low-precision storage through peft's adapter loading
  (applied by optimize() itself).
"""
