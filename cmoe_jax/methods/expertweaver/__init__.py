"""ExpertWeaver: GLU gate-activation profiles over calibration tasks, layer-adaptive shared
experts from the coefficient of variation, a gate-centroid router; the training-free
conversion (`weave_model`; `weave_streamed`, one layer in memory) and downcycling's objective (softmax routers + balance loss);
calibration tasks from WikiText articles or a task-diverse mix of pseudo-task formats."""
from cmoe_jax.methods.expertweaver.calib_tasks import arc_text, task_windows, wikitext_articles
from cmoe_jax.methods.expertweaver.task_mix import FORMATS, diverse_task_windows, format_counts, pseudo_tasks
from cmoe_jax.methods.expertweaver.convert import (WeaveConfig, layer_spec, validate, weave_model, weave_streamed,
                                                   woven_slices)
from cmoe_jax.methods.expertweaver.downcycle_objective import (downcycle_loss, downcycle_optimizer,
                                                              randomize_experts)
from cmoe_jax.methods.expertweaver.weave import WovenLayer, gate_profiles, weave_layer
from cmoe_jax.methods.expertweaver.job import (DEFAULT_TASKS, DIVERSE_NEEDS_ARC, MIXES, TaskCalibration,
                                               WeaverSettings, WeaverSteps, calibration_tasks)
from cmoe_jax.methods.expertweaver.report import layer_summary, write_report
from cmoe_jax.methods.expertweaver import flags
from cmoe_jax.methods.method import Method

METHOD = Method(name="expertweaver", command="convert", choices=("expertweaver",), title="ExpertWeaver",
                summary="expertweaver (layer-adaptive shared experts, gate-centroid router)",
                settings=WeaverSettings, steps=WeaverSteps, add_flags=flags.add_flags,
                from_args=flags.settings_from_args, check_args=flags.check_args, refuses=flags.REFUSES,
                refuse_note="it sizes experts by --experts and --sparsity, or --active F", single_process=True)

__all__ = ["arc_text", "task_windows", "wikitext_articles", "FORMATS", "diverse_task_windows",
           "format_counts", "pseudo_tasks", "WeaveConfig", "layer_spec", "validate",
           "weave_model", "weave_streamed", "woven_slices", "downcycle_loss", "downcycle_optimizer", "randomize_experts",
           "WovenLayer", "gate_profiles", "weave_layer", "DEFAULT_TASKS", "DIVERSE_NEEDS_ARC", "MIXES",
           "TaskCalibration", "WeaverSettings", "WeaverSteps", "calibration_tasks", "layer_summary",
           "write_report", "flags", "METHOD"]
