"""Read-only views of one stacked layer: a module over slices of the stacked arrays, whose
writes raise instead of changing a copy."""
from __future__ import annotations

import functools

from flax import nnx


class LayerViewError(AttributeError):
    """A write into a view of one stacked layer: it would change a copy, never the model."""


_VIEW_MESSAGE = ("this is a read-only view of one stacked layer: writing to it would change a "
                 "copy, not the model. Use model.set_layer(i, layer) to replace a layer")


@functools.cache
def _read_only_class(cls: type) -> type:
    """A twin of module or variable class `cls` whose writes raise `LayerViewError`."""
    def refuse(self, *args, **kwargs):
        raise LayerViewError(_VIEW_MESSAGE)

    if issubclass(cls, nnx.Variable):
        members = {"set_value": refuse, "set_raw_value": refuse}
    else:
        members = {"__setattr__": refuse, "__setitem__": refuse, "__delattr__": refuse}
    return type(cls.__name__, (cls,), {**members, "__slots__": (), "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__, "_view_of": cls})


def read_only(module: nnx.Module) -> nnx.Module:
    """`module` with every module and variable in it made read-only in place (a layer view)."""
    for _, node in list(nnx.iter_graph(module)):
        if isinstance(node, (nnx.Module, nnx.Variable)) and not hasattr(type(node), "_view_of"):
            object.__setattr__(node, "__class__", _read_only_class(type(node)))
    return module
