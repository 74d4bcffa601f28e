"""The Family record: what the rest of the code asks of a model family, declared next to its model.

A family is one module here (architecture, its `FAMILY` record) plus its Hugging Face conversion in lm_jax/hf/,
each registered with one line. Nothing outside models/ and hf/ compares family names (tests/test_family_api.py):
it asks the record. The family owns its facts: its model config fields (a `FIELDS` dict literal in its module,
which defaults.model_defaults merges into the shared ones), its costs (FLOPs, activation and KV-cache bytes) and
its config checks.
"""
import dataclasses
from typing import Callable

from lm_jax.models import costs, relayout

LAYOUTS = ("encoder", "decoder", "encoder_decoder")


@dataclasses.dataclass(frozen=True)
class Tokens:
  """What the family asks of its tokenizer."""
  spm: dict                  # SentencePiece trainer arguments that place its special pieces
  required: tuple            # special roles ('pad_id', 'eos_id', ...) its objectives need
  sentinels: bool = False    # 100 <extra_id_k> ids above the pieces (T5's span corruption)
  template: tuple = ("$A",)  # what transformers' post-processor puts around a text: roles and $A
  token_types: bool = False  # the model reads token_type_ids (a second text is segment 1)


def head_counts(cfg) -> dict:
  """{model config field: heads} of the head counts the mesh's 'heads' axis splits: num_heads, and num_kv_heads
  where the family has it and sets it (0 = num_heads)."""
  out = {"num_heads": cfg.num_heads}
  if cfg.get("num_kv_heads", 0):
    out["num_kv_heads"] = cfg.num_kv_heads
  return out


def check_heads_split(cfg, mesh: dict) -> None:
  """Every head count divisible by mesh['tensor'] (Family.check_mesh's default)."""
  for name, n in head_counts(cfg).items():
    if n % mesh["tensor"]:
      raise ValueError(f"config.model.{name}={n} is not divisible by config.mesh.tensor={mesh['tensor']}")


def place_layer(cfg, i: int) -> tuple[tuple[str, ...], int] | None:
  """Where looped layer i (`layers_<i>` of a stack) sits in cfg's layout: (the keys that replace `layers_<i>`, its
  index along their leading axis), or None where it stays looped (Family.place_layer's default: every stack scanned
  or looped whole)."""
  return (("layers",), i) if cfg.scan_layers else None


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family (see lm_jax/models/__init__.py for how each field is used).

  layout: 'encoder' (bidirectional, no generation), 'decoder' (causal, prompts left-padded, positions counted from
  each row's first token, decode_step(cfg, params, ids, cache, mask, positions)) or 'encoder_decoder' (the prompt
  is the encoder input, the decoder starts from model.decoder_start_token_id, decode_step(cfg, params, ids, cache)).
  """
  name: str
  layout: str
  Model: type                # linen Module; Model(cfg)(batch, train=False) -> dict of outputs
  example_batch: Callable    # cfg -> a tiny batch of its input keys, for init / eval_shape
  forward_flops: Callable    # (cfg, flops.Lengths) -> matmul FLOPs of one forward pass on one example
  tokens: Tokens
  fields: dict = dataclasses.field(default_factory=dict)   # its own model config fields and defaults: FIELDS
  sizes: tuple = ()          # model config fields that must be positive integers, beyond the shared ones
  check_config: Callable = lambda cfg: None   # family-specific config checks, after the generic ones
  check_mesh: Callable = check_heads_split   # (cfg, {'data'|'fsdp'|'tensor': size}) -> None: heads vs the mesh
  activation_bytes: Callable = costs.one_stack     # (cfg, flops.Lengths, div) -> bytes one example keeps for
                                                   # the backward pass per device (lm_jax/models/costs.py)
  kv_cache_bytes: Callable | None = None  # (cfg, rows, length, inputs=0) -> bytes of a decoding cache's keys/values
  heads: tuple = ()          # top-level param names that are task heads (summary counts them apart)
  # (source model cfg, target model cfg, host params of source) -> the params in target's scan_layers layout: a
  # checkpoint of a run with the other setting (init_from). Every stack is scanned or looped whole unless the family
  # groups its layers (ModernBERT).
  rescan: Callable = lambda source, target, params: relayout.relayout(params, target.scan_layers)
  place_layer: Callable = place_layer
  # (cfg, tree, scan) -> a nested dict shaped like (part of) the params, on the host, with its layers looped
  # (scan=False) or in cfg's layout (scan=True): adapters, PEFT tensors, the layers reinit_top_layers resets.
  relaid: Callable = lambda cfg, tree, scan: relayout.relayout(tree, scan and cfg.scan_layers)
  learned_positions: bool = False   # max_positions bounds the sequence length
  init_cache: Callable | None = None     # (cfg, params, batch, max_length) -> KV cache (decoders)
  decode_step: Callable | None = None    # see layout

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"family {self.name!r}: layout {self.layout!r} is not one of {', '.join(LAYOUTS)}")

  def __reduce__(self):
    """Pickled as its name, read back from the registry (importing lm_jax.models registers every family): a
    tokenizing worker process gets the family its tokenizer is checked against, whose functions may be lambdas."""
    return family, (self.name,)


_FAMILIES: dict[str, Family] = {}


def register(record: Family) -> Family:
  """Makes `record` available as model.family=record.name."""
  _FAMILIES[record.name] = record
  return record


def names() -> list[str]:
  return sorted(_FAMILIES)


def family(model_cfg_or_name) -> Family:
  """The Family record of a model config or a family name; a one-line ValueError for an unknown one."""
  name = getattr(model_cfg_or_name, "family", model_cfg_or_name)
  if name not in _FAMILIES:
    raise ValueError(f"unknown model.family {name!r}; known: {', '.join(names())}")
  return _FAMILIES[name]
