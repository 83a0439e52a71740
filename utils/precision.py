"""The dtype arithmetic that must not round below fp32, and not below float64 either when the
computation is float64 (the CPU's exactness proofs: model.dtype=float64, docs/development.md
"How the tests prove equality")."""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch.overrides import TorchFunctionMode

from utils.device_ops import ops_for


def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fp32, or as it is when wider (float64)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class _KeepFloat64(TorchFunctionMode):
    """Turns the float64 -> fp32 casts that models write for their fp32 islands (transformers'
    RMSNorm computes in fp32 whatever its input; attention softmaxes in fp32) into no-ops, casts
    of integers to fp32 (the rotary embedding's positions) into casts to float64, and
    computes GELU from its formula where the device's op is not exact in float64 (torch_xla 2.9
    lowers it with its constants rounded to fp32, 7e-9 off: utils/device_ops.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is not None and not source.is_floating_point() and not source.is_complex():
            # Integers made fp32 (positions, for the rotary angles): float64 instead, so that the
            # angles and their sines are float64, not fp32 values whose sine each runtime's fp32
            # kernel rounds its own way (XLA:CPU's and ATen's differ by 6e-8).
            if func is torch.Tensor.float:
                return source.to(torch.float64)
        if source is not None and source.dtype == torch.float64:
            if func is torch.nn.functional.gelu and ops_for(source).gelu_from_formula:
                return _gelu(source, *args[1:], **kwargs)
            if func is torch.Tensor.float or (func is torch.Tensor.type and _names_fp32(args[1:], kwargs)):
                return source
            if func is torch.Tensor.type_as and _is_fp32(args[1]):
                return source.to(args[1].device)
            if func is torch.Tensor.to:  # .to(torch.float32), .to(device, torch.float32), .to(an fp32 tensor)
                args = tuple(torch.float64 if a is torch.float32 else a.device if _is_fp32(a) else a for a in args)
                if kwargs.get("dtype") is torch.float32:
                    kwargs["dtype"] = torch.float64
            elif kwargs.get("dtype") is torch.float32 and func in _SOFTMAXES:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def _is_fp32(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32


def _names_fp32(args: tuple, kwargs: dict) -> bool:
    """Tensor.type's arguments name fp32: torch.float32, torch.FloatTensor or "torch.FloatTensor"."""
    named = args[0] if args else kwargs.get("dtype")
    return named is torch.float32 or named is torch.FloatTensor or named == "torch.FloatTensor"


def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """torch.nn.functional.gelu's definition, in x's dtype throughout."""
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))
    return 0.5 * x * (1 + torch.erf(x * math.sqrt(0.5)))


_SOFTMAXES = {torch.softmax, torch.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax,
              torch.Tensor.softmax, torch.Tensor.log_softmax}


def float64_throughout(model_dtype: torch.dtype):
    """A context in which a float64 model's forward stays float64 everywhere (see _KeepFloat64);
    nothing for any other dtype, whose fp32 islands are the model's own numerics."""
    return _KeepFloat64() if model_dtype == torch.float64 else contextlib.nullcontext()


def keeping_float64(function):
    """`function` run in float64_throughout: for a forward called again where the context of
    its first call is not (a checkpointed layer's recompute)."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        with _KeepFloat64():
            return function(*args, **kwargs)

    return run


def compiled_in_float64(backend):
    """A torch.compile backend that compiles a float64 graph as `backend` (a name or a backend)
    would, with float64_throughout's rules applied to the graph first: for the regions dynamo
    traces without the torch-function modes around them (a checkpoint's, whose body it traces as
    a subgraph of its own: a compiled layer's RMSNorm there computed in fp32, 1e-7 off)."""
    from torch._dynamo import lookup_backend

    compile_graph = lookup_backend(backend) if isinstance(backend, str) else backend

    def compile_float64(graph_module: torch.fx.GraphModule, example_inputs):
        for module in graph_module.modules():  # the graph, and the subgraphs of its regions
            if isinstance(module, torch.fx.GraphModule):
                _keep_float64_in(module)
        return compile_graph(graph_module, example_inputs)

    return compile_float64


def _keep_float64_in(graph_module: torch.fx.GraphModule) -> None:
    """_KeepFloat64's casts, on the graph's nodes by the dtype dynamo recorded for their first
    argument: a float64 tensor made fp32 (`.float()`, `.to(torch.float32)`, a softmax's dtype)
    stays float64, and integers made fp32 by `.float()` become float64."""
    def widened(value):
        return torch.float64 if value is torch.float32 else value

    for node in graph_module.graph.nodes:
        source = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        value = source.meta.get("example_value") if source is not None else None
        if not isinstance(value, torch.Tensor):
            continue
        if value.dtype == torch.float64:
            node.args = torch.fx.node.map_aggregate(node.args, widened)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, widened)
        if node.op == "call_method" and node.target == "float" and (
                value.dtype == torch.float64 or not (value.is_floating_point() or value.is_complex())):
            node.target = "double"
    graph_module.recompile()
