"""LoRA hyper-parameters: one validated dataclass, convertible to and from PEFT's config."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


# The name of a model's only adapter: PEFT's own ("default"), which it also strips from the keys
# it saves, so a set of one adapter reads and writes as PEFT's single adapter does.
DEFAULT_ADAPTER = "default"


def matches_target(module_name: str, target: str) -> bool:
    """PEFT's suffix rule: "q_proj" matches "q_proj" and "model.layers.0.self_attn.q_proj",
    not "model.layers.0.self_attn.xq_proj"."""
    return module_name == target or module_name.endswith("." + target)


def lora_scaling(alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


@dataclass
class LoraConfig:
    """What to adapt and how strongly.

    r: rank of the update B A; A is [r, in], B is [out, r].
    alpha: scale numerator; the update is multiplied by `alpha / r`
        (`alpha / sqrt(r)` with rsLoRA), exactly as PEFT computes it.
    dropout: dropout probability on the LoRA branch's input only (the base path never drops).
    target_modules: `nn.Linear` names matched by suffix, e.g. "q_proj" matches
        "model.layers.0.self_attn.q_proj". Every target must match at least one layer.
    use_rslora: rank-stabilised scaling alpha / sqrt(r) (Kalajdzievski 2023), which keeps the
        update's magnitude steady as r grows.
    modules_to_save: modules trained in full beside the LoRA (PEFT's modules_to_save), matched
        by suffix as targets are: [embed_tokens, lm_head] for a new language's continued
        pretraining (lora_logic/modules_to_save.py). None: the LoRA alone.
    trainable_token_indices: rows of the embeddings trained beside the LoRA (PEFT's
        trainable_token_indices, lora_logic/trainable_tokens.py): a list of token ids (the input
        embedding's rows; a tied output layer shares them), or {module name: ids}.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    use_rslora: bool = False
    modules_to_save: list[str] | None = None
    trainable_token_indices: list[int] | dict[str, list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ValueError(f"lora.r must be a positive integer, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.target_modules, str):
            # A lone string is a common YAML slip ("target_modules: q_proj"); accept it as one name.
            self.target_modules = [self.target_modules]
        targets = list(self.target_modules)
        if not targets or not all(isinstance(t, str) and t.strip() for t in targets):
            raise ValueError(
                f"lora.target_modules must be a non-empty list of module names, got {self.target_modules!r}"
            )
        if len(set(targets)) != len(targets):
            raise ValueError(f"lora.target_modules has duplicates: {targets!r}")
        self.target_modules = targets
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"lora.use_rslora must be true or false, got {self.use_rslora!r}")
        if isinstance(self.modules_to_save, str):
            self.modules_to_save = [self.modules_to_save]
        if self.modules_to_save is not None:
            saved = list(self.modules_to_save)
            if not all(isinstance(m, str) and m.strip() for m in saved):
                raise ValueError(f"lora.modules_to_save must be a list of module names, got {self.modules_to_save!r}")
            both = sorted(set(saved) & set(targets))
            if both:
                raise ValueError(f"lora.modules_to_save {both} are LoRA targets too; a module is adapted by a LoRA "
                                 "or trained in full, not both: remove it from one of the two lists")
            self.modules_to_save = list(dict.fromkeys(saved)) or None
        rows = self.trainable_token_indices
        if rows is not None:
            lists = list(rows.values()) if isinstance(rows, dict) else [rows]
            if not lists or not all(isinstance(ids, (list, tuple)) and ids and all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids) for ids in lists):
                raise ValueError("lora.trainable_token_indices must be a list of token ids (>= 0), or {module name: "
                                 f"[ids]}}, got {rows!r}")
            if isinstance(rows, dict) and self.modules_to_save and set(rows) & set(self.modules_to_save):
                raise ValueError(f"lora.trainable_token_indices and lora.modules_to_save both name "
                                 f"{sorted(set(rows) & set(self.modules_to_save))}: train a module whole or by rows")
            self.trainable_token_indices = ({k: list(v) for k, v in rows.items()} if isinstance(rows, dict)
                                            else list(rows))

    @property
    def scaling(self) -> float:
        """The factor on B A x: alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's formula)."""
        return lora_scaling(self.alpha, self.r, self.use_rslora)

    def to_peft_dict(self, base_model_name_or_path: str, revision: str | None = None,
                     tied_embeddings: bool = False) -> dict:
        """The `adapter_config.json` PEFT and vLLM read; fields we do not use get PEFT's defaults.
        revision: the base's Hub commit (PEFT loads the base at it); tied_embeddings: the modules
        trained in full include a tied embedding and output layer, one weight (PEFT's
        `ensure_weight_tying`, so that PEFT ties them again when it loads the adapter)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model_name_or_path,
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": self.use_rslora,
            "use_dora": False,
            "modules_to_save": list(self.modules_to_save) if self.modules_to_save else None,
            "ensure_weight_tying": tied_embeddings,
            "trainable_token_indices": (copy.deepcopy(self.trainable_token_indices)
                                        if self.trainable_token_indices is not None else None),
            "init_lora_weights": True,
            "inference_mode": True,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": revision,
        }

    @classmethod
    def from_peft_dict(cls, data: dict, source: str = "adapter_config.json") -> "LoraConfig":
        """Read a PEFT LoRA config, refusing features this implementation does not have."""
        if data.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{source}: peft_type is {data.get('peft_type')!r}; only LORA adapters are supported")
        unsupported = {
            "use_dora": (False, None),
            "fan_in_fan_out": (False, None),
            "bias": ("none", None),
            "rank_pattern": ({}, None),
            "alpha_pattern": ({}, None),
            "layers_to_transform": (None,),
        }
        for key, allowed in unsupported.items():
            if key in data and data[key] not in allowed:
                raise ValueError(
                    f"{source}: {key}={data[key]!r} is not supported by lora_logic "
                    f"(supported: {allowed[0]!r}); merge or re-train the adapter without it"
                )
        targets = data.get("target_modules")
        if isinstance(targets, str) and not targets.isidentifier():
            # PEFT reads a string as a regular expression over full module names.
            raise ValueError(
                f"{source}: target_modules is the regular expression {targets!r}; lora_logic matches "
                "module names by suffix, so list the names instead (e.g. [\"q_proj\", \"v_proj\"])"
            )
        try:
            return cls(
                r=data["r"],
                alpha=data["lora_alpha"],
                dropout=data.get("lora_dropout", 0.0),
                target_modules=data["target_modules"],
                use_rslora=data.get("use_rslora", False),
                modules_to_save=data.get("modules_to_save") or None,
                trainable_token_indices=data.get("trainable_token_indices"),
            )
        except KeyError as missing:
            raise ValueError(f"{source}: required field {missing} is missing") from None


def adapter_set(adapters: "LoraConfig | Mapping[str, LoraConfig]") -> dict[str, LoraConfig]:
    """A set of adapters, {name: config} in their order: a LoraConfig alone is the set of one
    adapter named DEFAULT_ADAPTER (PEFT's `get_peft_model(model, config)` names it so too)."""
    if isinstance(adapters, LoraConfig):
        return {DEFAULT_ADAPTER: adapters}
    if not adapters:
        raise ValueError("a set of adapters needs at least one {name: LoraConfig}")
    return dict(adapters)
