"""Everything Lightning, for the stages that train (bootstrap, distill, reinforce).

- `qat`: what trains in a quantized model (`prepare_qat`), loading it, fp32 modules;
- `losses`: the distillation and the reinforce losses (pure tensor math);
- `distill`, `reinforce`, `lm`: the LightningModules and their step-indexed data;
- `fit`: a stage's validated fit (checkpoints, resume, the best check or the input kept) and
  the trained tensors read back, consolidated from ZeRO shards under DeepSpeed;
- `resume`, `guards`: exact resume after a kill, and the NaN/Inf guard;
- `trainer`, `devices`, `deepspeed_cpu`, `npu`: the Trainer for the configured accelerator and
  strategy, and the checks that it fits the machine.
"""
