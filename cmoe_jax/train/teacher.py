"""The teacher of a distillation or layer-wise recovery: which model, whether it fits the
student, its identity for the resume fingerprint, and its weights sharing the student's.

The default teacher is the model a converted model was carved from (`source_model` in its
manifest). A CMoE model keeps its source's embeddings, attention and norms unchanged, so
`SharedTeacher` holds only the teacher's weights that differ from the student's (the dense
FFNs); inside the train step the teacher is rebuilt from the student's frozen weights plus
those, so the shared weights exist once in memory.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from cmoe_jax.checkpoint import MANIFEST
from cmoe_jax.errors import CmoeError, TrainError
from cmoe_jax.jobs import SourceModel


def teacher_name(student_path: Path, student: str, teacher: str | None) -> str:
    """`teacher`, else the converted student's source model (one-line error when it has none)."""
    if teacher:
        return str(teacher)
    manifest = Path(student_path) / MANIFEST
    source = json.loads(manifest.read_text()).get("source_model") if manifest.is_file() else None
    if not source:
        raise TrainError(f"{student} names no source model (no conversion manifest): pass "
                         "--teacher MODEL to say which model to distil from")
    return str(source)


def open_teacher(name: str, student: SourceModel, student_tokenizer) -> SourceModel:
    """The teacher's `SourceModel`, refused (one line) when its vocabulary or tokenizer differs
    from the student's or its layers do not match (the distillation compares them token by
    token and layer by layer)."""
    try:
        teacher = SourceModel(name)
    except (OSError, ValueError, CmoeError) as e:
        raise TrainError(f"cannot open the teacher {name!r} ({str(e).splitlines()[0]}): pass "
                         "--teacher MODEL naming the dense model to learn from") from None
    s, t = student.config, teacher.config
    if t.vocab_size != s.vocab_size:
        raise TrainError(f"the teacher {name} has a vocabulary of {t.vocab_size} tokens, the student "
                         f"{s.vocab_size}: distil from a model with the student's tokenizer (--teacher)")
    t_tok = teacher.require_tokenizer("its tokenizer must be compared with the student's",
                                      " (pass --teacher MODEL with one)")
    if t_tok.hf.get_vocab() != student_tokenizer.hf.get_vocab():
        raise TrainError(f"the teacher {name} has another tokenizer than the student (same size, "
                         "different tokens): distil from a model with the student's tokenizer")
    if (t.num_layers, t.hidden_size) != (s.num_layers, s.hidden_size):
        raise TrainError(f"the teacher {name} has {t.num_layers} layers of width {t.hidden_size}, the "
                         f"student {s.num_layers} of {s.hidden_size}: pass its dense source as --teacher")
    return teacher


def teacher_identity(teacher: SourceModel) -> str:
    """A short digest of the teacher's files (names, sizes, times): a resume with another
    teacher is refused like one with other settings."""
    return hashlib.sha256(json.dumps(teacher.files(), sort_keys=True).encode()).hexdigest()[:16]


def _leaves(state) -> dict:
    path_leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(p): leaf for p, leaf in path_leaves}


class SharedTeacher:
    """A frozen teacher model that borrows every weight equal to the student's.

    `own` holds only the teacher's other weights (keyed by their path); `model(student,
    own)` rebuilds the teacher (traceable: the train step calls it inside `jit`)."""

    def __init__(self, graphdef, state, student_state):
        self.graphdef = graphdef
        self.treedef = jax.tree.structure(state)
        mine, theirs = _leaves(state), _leaves(student_state)
        self.keys = list(mine)
        self.shared = {k for k, a in mine.items() if k in theirs and _same(a, theirs[k])}
        self.own = {k: a for k, a in mine.items() if k not in self.shared}
        self.shared_bytes = sum(int(mine[k].nbytes) for k in self.shared)

    def model(self, student_state, own: dict):
        theirs = _leaves(student_state)
        leaves = [theirs[k] if k in self.shared else own[k] for k in self.keys]
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))

    def memory(self) -> dict:
        """Bytes of the teacher's weights held apart from the student's, and borrowed."""
        return {"teacher_own_bytes": sum(int(a.nbytes) for a in self.own.values()),
                "teacher_shared_bytes": self.shared_bytes}


def _same(a, b) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and bool(jnp.array_equal(a, b)))
