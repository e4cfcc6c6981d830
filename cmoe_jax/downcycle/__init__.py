"""Downcycling (ExpertWeaver's sparse start, then continued pre-training): weave a dense model
into an MoE with softmax routers and train every parameter.

`downcycle(model, DowncycleSettings(...), out=...)` is the job behind `python -m
cmoe_jax.downcycle` and `cmoe-jax downcycle` (`cli.py` turns the flags into the settings);
its objective is ExpertWeaver's (`cmoe_jax.methods.expertweaver`: `downcycle_loss`,
`downcycle_optimizer`, `randomize_experts`)."""
from cmoe_jax.downcycle.api import downcycle
from cmoe_jax.downcycle.job import DowncycleJob
from cmoe_jax.downcycle.settings import INITS, DowncycleSettings, DowncycleTraining

__all__ = ["downcycle", "DowncycleSettings", "DowncycleTraining", "INITS", "DowncycleJob"]
