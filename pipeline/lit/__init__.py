"""Everything Lightning, for the stages that train (bootstrap, distill, reinforce): the shared
`TrainConfig` and validated fit, the LightningModules and losses, resume, guards, the Trainer.
"""
