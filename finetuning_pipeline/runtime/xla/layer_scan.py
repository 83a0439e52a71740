"""Run a model's decoder layers as one XLA loop: one layer traced and compiled, whatever the depth.

A Hugging Face model runs its decoder layers in a Python loop, so XLA sees a 32-layer model as
32 copies of the layer, traced and compiled 32 times over. Here the layers' weights are
stacked once ([layers, ...] per weight: the frozen base and the LoRA A/B alike) and the loop
becomes torch_xla's `scan`: the first layer (the template) is traced once with
`torch.func.functional_call` on one layer's slice of the stacks, forward and backward, and
XLA runs it in a While loop, so compile time no longer grows with depth (figures: docs/benchmarks.md,
"Host time per step and compile time").

`scan_decoder_layers(model)` swaps the model's layer list for a `ScannedLayers` that the
model's own forward iterates as before: it hands out one stand-in per layer; each records the
arguments the model passes to its layer (masks and rotary tables may differ per layer), and
the last one runs the scan. So the model's code is unchanged, as long as it passes each
layer's output straight to the next layer (checked: anything in between is an error, not a
silent skip).

The layers must be identical but for their weights: same modules, shapes and settings (a
Gemma 3 layer's sliding or full attention is a setting; such models are refused, naming the
setting). LoRA dropout keeps one mask per layer: each layer's salt is stacked with the weights.
"""

from __future__ import annotations

import torch
from torch import nn

from lora_logic.dropout import SeededDropout

# Differ from layer to layer and are handled: the index a layer uses in a KV cache (training
# runs without one), and a LoRA dropout's salt (stacked, a loop input).
_PER_LAYER_ATTRIBUTES = {"layer_idx", "salt"}
_UNSCANNED = "run this model's layers unscanned (train.scan_layers=false; without scan_decoder_layers)"


def scan_decoder_layers(model: nn.Module, activation_checkpointing: bool = False) -> "ScannedLayers":
    """Replace the decoder layers of a Hugging Face causal LM (`model.get_decoder().layers`) by
    a `ScannedLayers`, in place; returns it. activation_checkpointing: recompute each layer's activations in the
    backward (activation checkpointing, inside the loop) instead of keeping them."""
    scanned = ScannedLayers(
        _decoder_layers(model), activation_checkpointing=activation_checkpointing
    )  # (which checks them)
    model.get_decoder().layers = scanned
    return scanned


def scannable_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM, checked identical but for their weights;
    a ValueError says why they cannot be scanned. Scans nothing (a meta-device model will do)."""
    layers = _decoder_layers(model)
    check_identical(layers)
    return layers


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) < 2:
        raise ValueError(f"{type(model).__name__}: no list of decoder layers at get_decoder().layers to scan")
    return layers


class ScannedLayers(nn.Module):
    """The stacked weights of identical layers, and the stand-ins the model's loop calls."""

    def __init__(self, layers: nn.ModuleList, activation_checkpointing: bool = False) -> None:
        super().__init__()
        check_identical(layers)
        template = layers[0]
        self.count = len(layers)
        self.activation_checkpointing = activation_checkpointing
        # Template name -> registered name (module attribute names cannot hold dots).
        self.keys = {name: "stacked:" + name.replace(".", ":")
                     for name, _ in list(template.named_parameters()) + list(template.named_buffers())}
        for name, param in template.named_parameters():
            stacked = torch.stack([layer.get_parameter(name).detach() for layer in layers])
            self.register_parameter(self.keys[name], nn.Parameter(stacked, requires_grad=param.requires_grad))
            for layer in layers[1:]:  # replaced by the stacks: freed as we go (peak: one weight's stack more)
                layer.get_parameter(name).data = torch.empty(0, dtype=param.dtype, device=param.device)
        for name, buffer in template.named_buffers():
            self.register_buffer(self.keys[name], torch.stack([layer.get_buffer(name) for layer in layers]),
                                 persistent=False)
            owner, _, leaf = name.rpartition(".")
            for layer in layers[1:]:  # a quantized base's codes and scales are buffers: freed as the weights are
                setattr(layer.get_submodule(owner), leaf, torch.empty(0, dtype=buffer.dtype, device=buffer.device))
        # The trainable weights: LoRA's A and B (of each adapter, side by side), in module order.
        self.lora_names = [name for name, param in template.named_parameters() if param.requires_grad]
        self.dropouts = [name for name, m in template.named_modules() if isinstance(m, SeededDropout)]
        self.salt_keys = {name: "salt:" + name.replace(".", ":") for name in self.dropouts}
        for name, key in self.salt_keys.items():
            salts = [layer.get_submodule(name).salt for layer in layers]
            self.register_buffer(key, torch.tensor(salts, dtype=torch.int32), persistent=False)
        if getattr(template, "gradient_checkpointing", False):
            template.gradient_checkpointing = False  # the loop recomputes instead
        # Kept out of the module tree (its tensors would be listed twice): the template only
        # provides the code and settings; every tensor it uses comes from the stacks.
        self._template = [template.to("meta")]
        self._calls: list[tuple[tuple, dict]] = []
        self._returned = None
        self._bodies: dict[str, _LayerBody] = {}  # the scan's bodies by what decides their trace

    @property
    def template(self) -> nn.Module:
        return self._template[0]

    def train(self, mode: bool = True) -> "ScannedLayers":
        super().train(mode)
        self.template.train(mode)
        return self

    def seeded_dropouts(self) -> list[SeededDropout]:
        """The template's LoRA dropouts, for `set_dropout_seed` (they are outside the module tree)."""
        return [self.template.get_submodule(name) for name in self.dropouts]

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(self[:])

    def __getitem__(self, index):
        calls = [_LayerCall(self, i) for i in range(self.count)]
        return calls[index]

    def stacked_lora_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The stacked LoRA weights ([layers, r, in] and [layers, out, r]) under their names in a
        layer, in the template's order: what lora_logic finds a model's adapters by (lora_logic/adapters.py)."""
        return [(name, self.get_parameter(self.keys[name])) for name in self.lora_names]

    def _record(self, index: int, args: tuple, kwargs: dict):
        passed = args[0] if args else kwargs.get("hidden_states")
        if index == 0:
            self._calls = []
        elif not self._calls or passed is not self._returned:
            self._calls = []
            raise RuntimeError("ScannedLayers: the model changed the hidden states between two layers (or called "
                               f"them out of order), so they cannot run as one loop; {_UNSCANNED}")
        self._calls.append((args, kwargs))
        if index < self.count - 1:
            self._returned = passed
            return passed
        calls, self._calls, self._returned = self._calls, [], None
        return self._run(calls)

    def _run(self, calls: list[tuple[tuple, dict]]) -> torch.Tensor:
        from functorch.compile import default_partition, min_cut_rematerialization_partition

        from finetuning_pipeline.runtime.xla.scan import scan

        args, kwargs = calls[0]
        hidden = args[0] if args else kwargs["hidden_states"]
        inputs, arguments, static = _per_layer_arguments(
            [(a[1:], {k: v for k, v in kw.items() if k != "hidden_states"}) for a, kw in calls], self.count)
        weights = {name: getattr(self, key) for name, key in self.keys.items()}
        dropout = self._dropout_inputs()
        body = self._body(static, weights, inputs)
        partition = min_cut_rematerialization_partition if self.activation_checkpointing else default_partition
        saved = [(m.seed, m.salt) for m in self.seeded_dropouts()]
        try:
            body.arguments = arguments
            # A body of known settings is traced once: torch_xla's scan reuses its trace for the
            # same function and shapes (is_fn_pure); `_body` gives a new function whenever the
            # settings it cannot see in the shapes differ.
            out, _ = scan(body, hidden, (weights, inputs, dropout), partition_fn=partition,
                          is_fn_pure=body.reusable)
        finally:
            body.arguments = None
            for module, (seed, salt) in zip(self.seeded_dropouts(), saved):
                module.seed, module.salt = seed, salt
        return out

    def _body(self, static: str | None, weights: dict, inputs: list) -> "_LayerBody":
        """The scan's body for this call: the same function object as an earlier call's whenever
        nothing that decides the traced layer differs but the tensors' shapes and dtypes (which
        torch_xla's cache keys by itself): the template's settings (train or eval, dropout,
        attention, each module's flags), its config's, the arguments' static values, and which
        inputs need a gradient. A traced layer (forward and backward, by AOTAutograd) costs seconds
        of host time; without this every evaluation batch paid it again. static is None when an
        argument's static value has no reliable key: then a body of its own, traced afresh."""
        structure = _structure(self.template)
        if static is None or not all(_plain(value) for value in structure.values()):
            return _LayerBody(self.template, reusable=False)
        configs = {id(c): c for c in (getattr(m, "config", None) for m in self.template.modules()) if c is not None}
        key = repr((sorted(structure.items()), [_settings(c) for c in configs.values()], static,
                    [(name, w.requires_grad) for name, w in weights.items()], [t.requires_grad for t in inputs]))
        if key not in self._bodies:
            self._bodies[key] = _LayerBody(self.template, reusable=True)
        return self._bodies[key]

    def _dropout_inputs(self) -> dict:
        """{"seed": the micro-batch's dropout seeds per layer [layers, 1 or rows], "salts": each dropout's
        salt per layer}, or {} when no LoRA dropout is live (eval, or p 0)."""
        live = [m for m in self.seeded_dropouts() if m.training and m.p > 0]
        if not live:
            return {}
        seed = live[0].seed  # set_dropout_seed gives every dropout the same one
        if seed is None:
            raise RuntimeError("ScannedLayers: LoRA dropout needs a seed per micro-batch (set_dropout_seed) when "
                               "the layers run as one loop; random draws cannot be traced into it")
        seed = seed.to(torch.int32).reshape(1, -1)  # one, or one per sequence
        return {"seed": seed.expand(self.count, seed.shape[1]),
                "salts": {name: getattr(self, key) for name, key in self.salt_keys.items()}}

    def extra_repr(self) -> str:
        return (f"layers={self.count}, template={type(self.template).__name__}, "
                f"activation_checkpointing={self.activation_checkpointing}")


class _LayerBody:
    """One layer of the loop, as the scan traces it: the template called on one layer's slices of
    the stacks. It holds the template and the current call's `arguments` (set for the call, then
    cleared), not the ScannedLayers: no cycle keeps a model's stacks alive once it is dropped."""

    def __init__(self, template: nn.Module, reusable: bool) -> None:
        self.template, self.reusable = template, reusable
        self.arguments = None

    def __call__(self, h, xs):
        tensors, layer_inputs, dropout = xs
        for name, salt in dropout.get("salts", {}).items():
            module = self.template.get_submodule(name)
            module.seed, module.salt = dropout["seed"], salt
        rest, named = self.arguments(layer_inputs)
        out = torch.func.functional_call(self.template, tensors, (h, *rest), named, strict=True)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"ScannedLayers: a {type(self.template).__name__} returned {type(out).__name__}; "
                            "only layers that return their hidden states can be scanned")
        return out, None


class _LayerCall:
    """What the model's loop calls in place of layer `index`."""

    def __init__(self, owner: ScannedLayers, index: int) -> None:
        self.owner, self.index = owner, index

    def __call__(self, *args, **kwargs):
        return self.owner._record(self.index, args, kwargs)


def _per_layer_arguments(calls: list, count: int):
    """(the tensors of the layers' arguments, each [layers, ...]; a function that rebuilds one
    layer's arguments from its slices of them; the static values and structure as a key, None if
    a static value is not a plain value whose repr stands for it).

    Every layer must get arguments of one structure (torch's pytree). A tensor every layer got
    is expanded (no copy until XLA needs the loop's input), tensors that differ are stacked;
    anything else (flags, None) must be equal for every layer."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat = [tree_flatten(call) for call in calls]
    leaves, spec = flat[0]
    if any(other != spec for _, other in flat):
        raise ValueError(f"ScannedLayers: the model passes its layers arguments of different structures; {_UNSCANNED}")
    slots, inputs = [], []
    for slot, first in enumerate(leaves):
        values = [layer_leaves[slot] for layer_leaves, _ in flat]
        if isinstance(first, torch.Tensor):
            if all(v is first for v in values):
                inputs.append(first.expand(count, *first.shape))
            elif all(v.shape == first.shape for v in values):
                inputs.append(torch.stack(values))
            else:
                raise ValueError(f"ScannedLayers: argument {slot} of the layers differs in shape; {_UNSCANNED}")
            slots.append(slot)
        elif not all(v is first or v == first for v in values):
            raise ValueError(
                f"ScannedLayers: argument {slot} differs from layer to layer ({first!r}, ...); {_UNSCANNED}"
            )

    def arguments(slices: list[torch.Tensor]):
        rebuilt = list(leaves)  # the static values as they are, the tensors from this layer's slices
        for slot, value in zip(slots, slices):
            rebuilt[slot] = value
        return tree_unflatten(rebuilt, spec)

    static = [None if slot in slots else leaf for slot, leaf in enumerate(leaves)]
    plain = all(_plain(value) for value in static)
    return inputs, arguments, repr((str(spec), slots, static)) if plain else None


def _plain(value) -> bool:
    """A value whose repr is the value (no object identity in it)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return isinstance(value, (bool, int, float, str, type(None), torch.dtype))


def _settings(config) -> list:
    """A config's plain attributes (private ones too: a model's attention implementation is one)."""
    return sorted((name, value) for name, value in vars(config).items() if _plain(value))


def check_identical(layers: nn.ModuleList) -> None:
    """Refuse layers that differ in anything but their weights, naming the difference."""
    template = layers[0]
    reference = _structure(template)
    for index, layer in enumerate(layers[1:], start=1):
        found = _structure(layer)
        if found == reference:
            continue
        for key in sorted(set(reference) | set(found)):
            if reference.get(key) != found.get(key):
                raise ValueError(f"decoder layers 0 and {index} differ in {key} ({reference.get(key)!r} vs "
                                 f"{found.get(key)!r}); only identical layers run as one loop")


def _structure(layer: nn.Module) -> dict:
    """Everything that decides a layer's computation except its tensors' values."""
    found = {}
    for name, module in layer.named_modules():
        found[f"{name or '<layer>'}: type"] = type(module).__name__
        for attribute, value in vars(module).items():
            if attribute.startswith("_") or attribute in _PER_LAYER_ATTRIBUTES:
                continue
            if isinstance(value, (bool, int, float, str, type(None), tuple, list)):
                found[f"{name}.{attribute}" if name else attribute] = value
    for name, tensor in list(layer.named_parameters()) + list(layer.named_buffers()):
        found[f"{name}: tensor"] = (tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
    return found
