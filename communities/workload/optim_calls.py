"""torch.optim's methods called without loading torch's compiler.

torch.optim guards its methods against ``torch.compile``: ``add_param_group`` (run by every
optimizer's constructor), ``zero_grad``, ``state_dict`` and ``load_state_dict`` through
``torch._disable_dynamo``, and ``step`` through ``_use_grad_for_differentiable``. Either guard imports
``torch._dynamo`` on its first call: 3.3 s of the 10 s a tiny two-replica run takes on one core of
the project's machine, paid by every rank, for a compiler the engine never runs. Outside a compiled
region the guards change nothing but the grad mode, so the engine calls what they wrap.

``skip_compiler_guards`` marks the guarded methods as already disabled (the cache torch keeps on each,
``__dynamo_disable``), once per process and only while ``torch._dynamo`` is not loaded: a process that
has loaded it (a plugin that compiles its model) keeps torch's own guards. ``step`` runs an optimizer's
step with gradients off, as the guard would. Where a torch release lacks either mechanism, both fall
back to torch's own calls: the same numbers, the import paid.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Dict, Optional, Type

import torch
from torch.optim import optimizer as torch_optimizer

_marked = False
_raw_steps: Dict[Type[torch.optim.Optimizer], Optional[Callable[..., Any]]] = {}


def _is_guard(fn: object, file_suffix: str, name: str) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_name == name and code.co_filename.endswith(file_suffix)


def skip_compiler_guards() -> None:
    """Mark torch.optim.Optimizer's ``torch._disable_dynamo`` methods as disabled, so their first call does not
    import torch._dynamo; once per process, and never after torch._dynamo is loaded."""
    global _marked
    if _marked or "torch._dynamo" in sys.modules:
        return
    for fn in vars(torch.optim.Optimizer).values():
        inner = getattr(fn, "__wrapped__", None)
        if inner is not None and _is_guard(fn, "_compile.py", "inner"):
            setattr(inner, "__dynamo_disable", inner)  # the cache torch's guard fills with torch._dynamo.disable(fn)
    _marked = True


def _raw_step(cls: Type[torch.optim.Optimizer]) -> Optional[Callable[..., Any]]:
    """``cls.step`` without torch's profiling hook and compiler guard, or None where torch's step is not that
    guard around a function (then ``opt.step()`` is called)."""
    if cls not in _raw_steps:
        fn: Any = cls.step
        while getattr(fn, "__wrapped__", None) is not None and not _is_guard(fn, "optimizer.py", "_use_grad"):
            fn = fn.__wrapped__  # the profiling hook torch's constructor puts around step
        _raw_steps[cls] = inspect.unwrap(fn) if _is_guard(fn, "optimizer.py", "_use_grad") else None
    return _raw_steps[cls]


def _hooked(opt: torch.optim.Optimizer) -> bool:
    """Whether a step hook is registered (on this optimizer or on all): then torch's own step runs them."""
    mine = (getattr(opt, "_optimizer_step_pre_hooks", None), getattr(opt, "_optimizer_step_post_hooks", None))
    everyone = (getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
                getattr(torch_optimizer, "_global_optimizer_post_hooks", None))
    return any(bool(hooks) for hooks in mine + everyone)


def step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()`` as torch computes it, without importing torch._dynamo (the guard's own effect outside a
    compiled region: gradients off for a non-differentiable optimizer); torch's own step where a step hook is
    registered."""
    raw = _raw_step(type(opt))
    if raw is None or opt.defaults.get("differentiable", False) or "torch._dynamo" in sys.modules or _hooked(opt):
        opt.step()
        return
    with torch.no_grad():
        raw(opt)
