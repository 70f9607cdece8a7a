"""A recipe's ``trainer.draft``: the draft config JSON SpecForge builds the draft from, typed, one model per draft
family (:data:`DRAFTS`, picked by ``trainer.family``): :class:`Eagle3Draft` (``LlamaForCausalLMEagle3`` or the MLA
``Eagle3DeepseekV2ForCausalLM``: one layer, its own draft vocabulary), :class:`DFlashDraft` and :class:`DSparkDraft`
(SpecForge's Qwen3-style ``DFlashDraftModel`` / ``DSparkDraftModel``: several layers, a block size, the target
layers it reads and a mask token in ``dflash_config``).

Scope: each field's type and range, unknown keys refused and a field of another family named as such
(:func:`validate_draft`, called once by the recipe's schema); what the draft must agree on with the rest of the
recipe (target width and vocabulary, ``trainer.block``, aux ids) is ``plan.recipes``'s. :meth:`DraftConfig.config`
is the JSON written beside the run (``draft_config.json``): the keys the recipe set, in its order, values as given.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

Count = Annotated[StrictInt, Field(gt=0)]
TokenId = Annotated[StrictInt, Field(ge=0)]
#: an int or a float, kept as written (so the draft config renders as the recipe wrote it)
Positive = Annotated[StrictInt | StrictFloat, Field(gt=0)]
NonNegative = Annotated[StrictInt | StrictFloat, Field(ge=0)]
#: a refused field: ``(field, message, value)``
Bad = tuple[str, str, Any]


def _refuse(title: str, errors: list[Bad]) -> ValidationError:
    """A ValidationError whose errors are ``(field, message, value)``: pydantic puts the field on the error's path
    (``trainer.draft.<field>``), so the one-line summary names it."""
    details = [
        InitErrorDetails(type=PydanticCustomError("draft_field", message), loc=(key,), input=value)
        for key, message, value in errors
    ]
    return ValidationError.from_exception_data(title, details)


def _checked(draft, bad: list[Bad]):
    """``draft`` when ``bad`` is empty, else the one-line refusal naming each bad field (an after-validator's
    return)."""
    if bad:
        raise _refuse(type(draft).__name__, bad)
    return draft


class _Ordered(BaseModel):
    """A strict JSON object that remembers the order of its keys, so :meth:`config` writes it back as given."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    _order: tuple[str, ...] = PrivateAttr(default=())
    family: ClassVar[str] = ""

    @classmethod
    def _peers(cls) -> dict[str, type[_Ordered]]:
        """The same object in each draft family, to name the family an unknown key belongs to."""
        return {}

    @model_validator(mode="wrap")
    @classmethod
    def _keep_order(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict):
            foreign = []
            for key in data:
                owners = [f for f, m in cls._peers().items() if f != cls.family and key in m.model_fields]
                if isinstance(key, str) and key not in cls.model_fields and owners:
                    message = f"{'/'.join(owners)} drafts only, not for trainer.family {cls.family}"
                    foreign.append((key, message, data[key]))
            if foreign:
                raise _refuse(cls.__name__, foreign)
        model = handler(data)
        if isinstance(data, dict) and model is not data:
            model._order = tuple(data)
        return model

    @model_serializer(mode="plain")
    def _dump(self) -> dict[str, Any]:
        """``model_dump`` (and a whole recipe's) is :meth:`config`: a dumped recipe validates back to the same
        draft, with no unset field turned into an explicit ``None``."""
        return self.config()

    def config(self) -> dict[str, Any]:
        """The JSON object: the keys set, in the order given (any set later by ``model_copy`` after them)."""
        keys = list(self._order) + [k for k in type(self).model_fields if k in self.model_fields_set]
        out: dict[str, Any] = {}
        for key in dict.fromkeys(keys):
            value = getattr(self, key)
            out[key] = value.config() if isinstance(value, _Ordered) else value
        return out


class EagleConfig(_Ordered):
    """EAGLE-3's ``eagle_config`` (SGLang and SpecForge read the aux ids from it)."""

    eagle_aux_hidden_state_layer_ids: list[StrictInt] | None = Field(
        default=None, min_length=1, description="The aux layers, SpecForge ids; must equal target.aux_layer_ids"
    )
    use_aux_hidden_state: StrictBool | None = Field(default=None, description="Feed the aux hidden states")


class DFlashConfig(_Ordered):
    """A block draft's ``dflash_config``: the target layers it reads and its mask token."""

    family: ClassVar[str] = "dflash"
    target_layer_ids: list[StrictInt] = Field(
        min_length=1, description="The target layers the draft reads, DFlash ids (position = id + 1)"
    )
    mask_token_id: TokenId = Field(description="The block's mask token; must equal trainer.block.mask_token_id")
    projector_type: str | None = Field(default=None, description="SpecForge's projector of the captured layers")

    @classmethod
    def _peers(cls) -> dict[str, type[_Ordered]]:
        return {"dflash": DFlashConfig, "dspark": DSparkConfig}


class DSparkConfig(DFlashConfig):
    """DSpark's ``dflash_config``: the DFlash fields and its Markov and confidence heads."""

    family: ClassVar[str] = "dspark"
    attention_mode: Literal["gqa", "mha"] | None = Field(
        default=None, description="gqa (SpecForge's default: fewer kv heads than query heads) or mha (as many)"
    )
    markov_rank: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None, description="Rank of the Markov head (0 or unset: none)"
    )
    markov_head_type: Literal["vanilla", "gated", "rnn"] | None = Field(default=None, description="Markov head kind")
    enable_confidence_head: StrictBool | None = Field(default=None, description="Train a confidence head")
    confidence_head_with_markov: StrictBool | None = Field(
        default=None, description="The confidence head also reads the Markov state"
    )
    confidence_head_alpha: NonNegative | None = Field(default=None, description="The confidence head's loss weight")


class DraftConfig(_Ordered):
    """What every draft config carries: the HF config fields of its transformer layers."""

    architectures: list[str] | None = Field(
        default=None, min_length=1, max_length=1, description="The draft's class, as the serving engine names it"
    )
    model_type: str | None = Field(default=None, description="HF model_type")
    hidden_size: Count = Field(description="Width; the target's (target.hidden_size)")
    intermediate_size: Count = Field(description="MLP width")
    num_attention_heads: Count = Field(description="Query heads")
    num_key_value_heads: Count | None = Field(default=None, description="KV heads (unset: num_attention_heads)")
    head_dim: Count | None = Field(default=None, description="Head dim (unset: hidden_size / num_attention_heads)")
    vocab_size: Count | None = Field(default=None, description="The target's vocabulary (target.vocab_size)")
    hidden_act: str | None = Field(default=None, description="MLP activation")
    rms_norm_eps: Positive | None = Field(default=None, description="RMSNorm epsilon")
    max_position_embeddings: Count | None = Field(default=None, description="Longest sample the rope covers")
    rope_theta: Positive | None = Field(default=None, description="Rope base")
    rope_scaling: dict[str, Any] | None = Field(default=None, description="HF rope_scaling (YaRN: the MLA draft)")
    rope_parameters: dict[str, Any] | None = Field(default=None, description="HF rope_parameters")
    attention_bias: StrictBool | None = Field(default=None, description="q/k/v/o biases")
    attention_dropout: NonNegative | None = Field(default=None, description="HF attention_dropout")
    initializer_range: Positive | None = Field(default=None, description="HF initializer_range")
    bos_token_id: TokenId | None = Field(default=None, description="BOS id")
    eos_token_id: TokenId | list[TokenId] | None = Field(default=None, description="EOS id(s)")
    pad_token_id: TokenId | None = Field(default=None, description="Pad id")
    tie_word_embeddings: StrictBool | None = Field(default=None, description="HF tie_word_embeddings")
    use_cache: StrictBool | None = Field(default=None, description="HF use_cache")
    torch_dtype: str | None = Field(default=None, description="HF torch_dtype")
    dtype: str | None = Field(default=None, description="HF dtype")
    transformers_version: str | None = Field(default=None, description="HF transformers_version")

    #: the classes ``architectures`` may name
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _peers(cls) -> dict[str, type[_Ordered]]:
        return dict(DRAFTS)

    @model_validator(mode="after")
    def _architecture(self) -> DraftConfig:
        """Every draft names an architecture of its family. (pydantic runs a family's own after-validators after
        its parent's: each states its check and hands what it refuses to :func:`_checked`.)"""
        arch = (self.architectures or [None])[0]
        bad = arch is not None and arch not in self.ARCHITECTURES
        return _checked(
            self,
            [("architectures", f"{self.family} drafts are {' or '.join(self.ARCHITECTURES)}", arch)] if bad else [],
        )


#: the MLA draft's attention sizes: all of them or none
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


class Eagle3Draft(DraftConfig):
    """An EAGLE-3 draft: ``LlamaForCausalLMEagle3``, or the MLA ``Eagle3DeepseekV2ForCausalLM`` when it has the
    :data:`MLA_FIELDS`. One layer (SGLang refuses more), its own vocabulary of ``draft_vocab_size`` tokens."""

    family: ClassVar[str] = "eagle3"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM")
    num_hidden_layers: Literal[1] | None = Field(default=None, description="Always 1 (SGLang refuses more)")
    vocab_size: Count = Field(description="The target's vocabulary (target.vocab_size)")
    draft_vocab_size: Count = Field(description="The draft's vocabulary (prepare --draft-vocab-size)")
    target_hidden_size: Count | None = Field(default=None, description="Width of the captured features")
    pretraining_tp: Count | None = Field(default=None, description="HF pretraining_tp (Llama)")
    eagle_config: EagleConfig | None = Field(default=None, description="The aux ids the draft names")
    q_lora_rank: Count | None = Field(default=None, description="MLA: query low-rank width")
    kv_lora_rank: Count | None = Field(default=None, description="MLA: key/value low-rank width")
    qk_nope_head_dim: Count | None = Field(default=None, description="MLA: non-rope query/key head dim")
    qk_rope_head_dim: Count | None = Field(default=None, description="MLA: rope query/key head dim")
    v_head_dim: Count | None = Field(default=None, description="MLA: value head dim")
    rope_interleave: StrictBool | None = Field(default=None, description="MLA: interleaved rope")
    fc_norm: StrictBool | None = Field(default=None, description="MLA: norm after the fc over the aux features")
    norm_output: StrictBool | None = Field(default=None, description="MLA: norm the layer's output")
    norm_before_residual: StrictBool | None = Field(default=None, description="MLA: norm before the residual")
    use_aux_norm: StrictBool | None = Field(default=None, description="MLA: norm each aux feature")

    @property
    def is_mla(self) -> bool:
        """Whether this is the MLA draft (``Eagle3DeepseekV2ForCausalLM``)."""
        return self.kv_lora_rank is not None

    @model_validator(mode="after")
    def _mla_sizes(self) -> Eagle3Draft:
        """The MLA sizes: all of them or none."""
        given = [k for k in MLA_FIELDS if getattr(self, k) is not None]
        missing = [k for k in MLA_FIELDS if given and k not in given]
        return _checked(self, [(k, f"the MLA draft ({', '.join(given)} set) needs it", None) for k in missing])


class DFlashDraft(DraftConfig):
    """A DFlash block draft (SpecForge's ``DFlashDraftModel``, Qwen3-style layers; no embedding or head of its own)."""

    family: ClassVar[str] = "dflash"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("DFlashDraftModel",)
    num_key_value_heads: Count = Field(description="KV heads")
    head_dim: Count = Field(description="Head dim")
    num_hidden_layers: Count = Field(description="Draft layers")
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = Field(
        default=None, description="One kind per layer (SGLang's DFLASH reads it)"
    )
    block_size: Annotated[StrictInt, Field(ge=2)] = Field(
        description="Tokens per block; must equal trainer.block.block_size"
    )
    num_target_layers: Count = Field(description="The target's layers; must equal target.num_layers")
    dflash_config: DFlashConfig = Field(description="The target layers read and the mask token")
    sliding_window: Count | None = Field(default=None, description="HF sliding_window")
    use_sliding_window: StrictBool | None = Field(default=None, description="HF use_sliding_window")
    max_window_layers: Count | None = Field(default=None, description="HF max_window_layers")
    auto_map: dict[str, str] | None = Field(default=None, description="HF auto_map (export drops it)")

    @model_validator(mode="after")
    def _layer_types(self) -> DFlashDraft:
        """One layer type per layer."""
        types, n = self.layer_types, self.num_hidden_layers
        bad = types is not None and len(types) != n
        return _checked(self, [("layer_types", f"{len(types)} entries for {n} layers", types)] if bad else [])


class DSparkDraft(DFlashDraft):
    """A DSpark block draft (SpecForge's ``DSparkDraftModel``): DFlash's layers, a Markov and a confidence head."""

    family: ClassVar[str] = "dspark"
    ARCHITECTURES: ClassVar[tuple[str, ...]] = ("DSparkDraftModel",)
    vocab_size: Count = Field(description="The target's vocabulary (the Markov head's width)")
    dflash_config: DSparkConfig = Field(description="The target layers read, the mask token and DSpark's heads")

    @model_validator(mode="after")
    def _heads(self) -> DSparkDraft:
        """What ``DSparkDraftModel`` demands of its heads: kv heads divide the query heads, fewer of them under
        the default ``attention_mode: gqa``, as many under ``mha``."""
        heads, kv, mode = self.num_attention_heads, self.num_key_value_heads, self.dflash_config.attention_mode
        why = None
        if heads % kv:
            why = f"{kv} must divide num_attention_heads {heads}"
        elif mode == "mha" and kv != heads:
            why = f"{kv} must equal num_attention_heads {heads} under dflash_config.attention_mode mha"
        elif mode != "mha" and kv >= heads:
            why = (
                f"{kv} must be < num_attention_heads {heads}: DSpark is GQA unless dflash_config.attention_mode is mha"
            )
        return _checked(self, [("num_key_value_heads", why, kv)] if why else [])


#: the draft config model of each ``trainer.family``
DRAFTS: dict[str, type[DraftConfig]] = {"eagle3": Eagle3Draft, "dflash": DFlashDraft, "dspark": DSparkDraft}


def validate_draft(family: str, raw: Any) -> DraftConfig:
    """``trainer.draft`` checked as a ``family`` draft (a ValidationError naming each bad field otherwise)."""
    model = DRAFTS[family]
    if isinstance(raw, DraftConfig):
        raw = raw.config()
    return model.model_validate(raw)
