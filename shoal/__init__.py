"""Shoal: decentralized deep learning and optimization.

Each process keeps its own model and averages it with its neighbors in a communication
graph (`shoal.topology`) instead of a global allreduce. This module is the
framework-neutral API over numpy arrays (and any buffer-protocol object); `shoal.torch`
offers the same names for torch tensors. Names and semantics follow BlueFog.
"""
import os as _os

from . import _checkout

if _checkout.unbuilt(_os.path.dirname(__file__)) and _checkout.load_installed(__name__, _os.path.dirname(__file__)):
    pass  # unbuilt sources of a checkout: the installed package has replaced this module
else:
    from . import topology
    from ._infer import InferDestinationFromSourceRanks, InferSourceFromDestinationRanks
    from ._api import build_api
    from ._numpy import ADAPTER as _ADAPTER
    from ._ops import Average, Max, Min, Product, ReduceOp, Sum
    from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
    from .basics import *  # noqa: F401,F403
    from .basics import __all__ as _basics_all

    from ._win import build_win_api
    globals().update(build_api(_ADAPTER))
    globals().update(build_win_api(_ADAPTER))
    globals().update({_n: getattr(topology, _n) for _n in topology.BLUEFOG_NAMES})  # shoal.RingGraph, ...

    __version__ = "0.1.0"
    __all__ = list(_basics_all) + sorted(build_api(_ADAPTER)) + sorted(build_win_api(_ADAPTER)) + [
        "Sum", "Average", "Min", "Max", "Product", "ReduceOp", "ProcessSet", "add_process_set", "global_process_set",
        "remove_process_set", "topology", "InferSourceFromDestinationRanks",
        "InferDestinationFromSourceRanks"] + list(topology.BLUEFOG_NAMES)
