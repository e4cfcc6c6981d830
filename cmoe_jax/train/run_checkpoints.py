"""Orbax checkpoints of a fine-tuning run, and the saved adapters.

A run directory holds `run_config.json` (the settings that decide the trajectory) and
`checkpoints/<step>/` written by an Orbax `CheckpointManager`: the adapters, router scales
u, selection biases b, the optimizer state, the step, and as JSON the data position and the
log so far. The optimizer state is stored as its list of leaves (its structure comes from
the optimizer itself on restore), everything else as nested dicts.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from cmoe_jax import distributed
from cmoe_jax.atomic_files import write_json_atomic
from cmoe_jax.errors import TrainError
from cmoe_jax.orbax_io import orbax_writes
from cmoe_jax.state_digests import array_digests, check_digests

RUN_CONFIG = "run_config.json"
STATE_DIGESTS = "state_digests"  # the meta key of a step's arrays' checksums
RESUME_DAMAGED = ("delete that step's directory to resume from the one before, or rerun without --resume "
                  "into a new --out")
ADAPTER_CONFIG = "adapter_config.json"


def _flat_opt(tree: dict) -> dict:
    """`tree` with its optimizer state `tree["opt"]` as `{"00000": leaf, ...}`."""
    return dict(tree, opt={f"{i:05d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree["opt"]))})


class RunCheckpoints:
    """Save / restore the train states of a run under `directory` (keeps the last `keep`).

    A state is a dict of pytrees with the optimizer state under "opt" (stored as its leaves);
    each job maps its own train state to such a dict (`lora_saved`, `FullTrainer`)."""

    def __init__(self, directory: Path, keep: int = 2):
        self.directory = Path(directory).absolute()
        if distributed.is_main():  # a save that failed (a full disk) or was killed left these
            for unfinished in self.directory.glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(unfinished, ignore_errors=True)
        distributed.barrier("run_checkpoints:unfinished")
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=False, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, tree: dict, meta: dict) -> None:
        """The step's state, with its arrays' checksums in its meta (`STATE_DIGESTS`)."""
        state = _flat_opt(tree)
        meta = dict(meta, **{STATE_DIGESTS: array_digests(state)})
        with orbax_writes(self.directory / str(step)):
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
            self.manager.wait_until_finished()

    def restore(self, step: int, like: dict) -> tuple[dict, dict]:
        """(tree, meta) of a saved step: `like` is a tree as `save` takes it (arrays or
        `ShapeDtypeStruct`s), whose shapes, shardings and optimizer structure it is given."""
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                              _flat_opt(like))
        got = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
        saved, meta = got["state"], dict(got["meta"])
        recorded = meta.pop(STATE_DIGESTS, None)  # None: saved before checksums were recorded
        if recorded is not None:
            check_digests(saved, recorded, self.directory / str(step) / "state", RESUME_DAMAGED)
        opt = jax.tree.unflatten(jax.tree.structure(like["opt"]), [saved["opt"][k] for k in sorted(saved["opt"])])
        return dict(saved, opt=opt), meta

    def close(self) -> None:
        self.manager.close()


def lora_saved(state: dict) -> dict:
    """A LoRA train state (`cmoe_jax.train.step`) as its checkpoint stores it."""
    return {"lora": state["trainable"]["lora"], "u": state["trainable"]["u"], "bias": state["bias"],
            "step": state["step"], "opt": state["opt"]}


def lora_state(saved: dict) -> dict:
    """The LoRA train state of a restored `lora_saved` tree."""
    return {"trainable": {"lora": saved["lora"], "u": saved.get("u", {})}, "opt": saved["opt"],
            "bias": saved.get("bias", {}), "step": saved["step"]}


def check_run_config(directory: Path, settings: dict, may_differ: tuple[str, ...] = ()) -> dict:
    """Refuse to resume a run directory written with other settings (one line naming them),
    except for the keys in `may_differ`; returns the saved settings."""
    path = Path(directory) / RUN_CONFIG
    if not path.exists():
        raise TrainError(f"--resume: {directory} has no {RUN_CONFIG}; it is not a fine-tuning run")
    saved = json.loads(path.read_text())
    diff = sorted(k for k in set(saved) | set(settings)
                  if saved.get(k) != settings.get(k) and k not in may_differ)
    if diff:
        detail = ", ".join(f"{k}: {saved.get(k)!r} there, {settings.get(k)!r} now" for k in diff)
        raise TrainError(f"--resume: {directory} was written with a different configuration ({detail}); "
                         "rerun with the same settings or without --resume into a new --out")
    return saved


def save_adapters(directory: Path, adapters: dict, u: dict, bias: dict, config: dict) -> None:
    """The adapters alone: `directory/state` (Orbax) and `directory/adapter_config.json`."""
    directory = Path(directory)
    if distributed.is_main():
        directory.mkdir(parents=True)
    distributed.barrier("save_adapters:mkdir")
    ckpt = ocp.StandardCheckpointer()  # every process calls Orbax; each piece is written once
    with orbax_writes(directory / "state"):
        ckpt.save((directory / "state").absolute(),
                  distributed.replicated_global({"lora": adapters, "u": u, "bias": bias}))
        ckpt.wait_until_finished()
    if distributed.is_main():
        write_json_atomic(directory / ADAPTER_CONFIG, config)
    distributed.barrier("save_adapters:config")


def load_adapters(directory: Path) -> tuple[dict, dict]:
    """(`{"lora", "u", "bias"}` as jax arrays, adapter config) saved by `save_adapters`."""
    import jax.numpy as jnp

    directory = Path(directory)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    path, ckpt = (directory / "state").absolute(), ocp.StandardCheckpointer()
    # onto this process's first device, whatever devices (processes) the run saved from
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                          ckpt.metadata(path).item_metadata.tree)
    return jax.tree.map(jnp.asarray, ckpt.restore(path, target)), config
