"""A dispatch mode that records the names of the ops run inside it (forward and backward), shared by the routing
tests: a routed call shows up as its torch.library op, an un-routed one as torch's."""
from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """``names``: the overload packet name of every op dispatched inside, in order (e.g. "aten.mm")."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
