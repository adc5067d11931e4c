"""What the benchmarks share: the timing loop (timing), the pass/fail target (targets), the JSON report writer
(report), the models and variants they train or run (train_models, train_variants, inference_models,
inference_variants), the optimizer steps they time (optim_steps) and the bf16 matmul roof of a train step (roof)."""
