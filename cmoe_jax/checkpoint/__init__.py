"""The converted-model directory format: what a converted (or fine-tuned) model directory
holds, how it is written and read back, and its readers' lock.

Layout of a converted (or fine-tuned) model directory:
    cmoe_manifest.json   source model, plan, calibration, per-layer neuron indices, timings
    state/               Orbax StandardCheckpointers: one per decoder layer (state/layer_0000,
                         ...) plus state/rest (embedding, final norm, LM head), manifest
                         "state_layout": "per_layer", written one layer at a time whatever
                         the in-memory storage (stacked layers are sliced one by one); older
                         directories hold one checkpoint of the whole state with its layers
                         per index, and still load
    tokenizer/           the source tokenizer (so `python -m cmoe_jax.eval` needs nothing else)

`layout`: the names, the manifest read and checked, the state pieces it describes; `save`:
a directory written; `restore`: a model read back onto its shardings; `readers`: the
`flock` that keeps a reader from seeing a directory half replaced. Where a job writes a
directory and how it publishes it (staged in `OUT.partial`, then renamed into place, so an
interrupted run never leaves a half-written model at the output path) is `cmoe_jax.jobs`'.
This package sits below both `loading` (which reads these directories) and `convert` /
`train` (which write them).
"""
from cmoe_jax.checkpoint.layout import (FORMAT, MANIFEST, PER_LAYER, is_converted, layer_part, read_manifest,
                                        verify_layout, without_layers)
from cmoe_jax.checkpoint.readers import readers_excluded, reading
from cmoe_jax.checkpoint.restore import restore_model
from cmoe_jax.checkpoint.save import save_converted, save_state_part, write_manifest

__all__ = ["FORMAT", "MANIFEST", "PER_LAYER", "is_converted", "layer_part", "read_manifest", "verify_layout",
           "without_layers", "readers_excluded", "reading", "restore_model", "save_converted",
           "save_state_part", "write_manifest"]
