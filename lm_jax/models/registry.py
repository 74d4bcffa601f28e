"""The Family record: what the rest of the code asks of a model family, declared next to its model.

A family is one module here (architecture, its `FAMILY` record) plus its Hugging Face conversion in lm_jax/hf/,
each registered with one line. Nothing outside models/ and hf/ compares family names (tests/test_family_api.py):
it asks the record.
"""
import dataclasses
from typing import Callable

LAYOUTS = ("encoder", "decoder", "encoder_decoder")


@dataclasses.dataclass(frozen=True)
class Tokens:
  """What the family asks of its tokenizer."""
  spm: dict                  # SentencePiece trainer arguments that place its special pieces
  required: tuple            # special roles ('pad_id', 'eos_id', ...) its objectives need
  sentinels: bool = False    # 100 <extra_id_k> ids above the pieces (T5's span corruption)
  template: tuple = ("$A",)  # what transformers' post-processor puts around a text: roles and $A
  token_types: bool = False  # the model reads token_type_ids (a second text is segment 1)


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
  sizes: tuple = ()          # model config fields that must be positive integers, beyond the shared ones
  check_config: Callable = lambda cfg: None   # family-specific config checks, after the generic ones
  heads: tuple = ()          # top-level param names that are task heads (summary counts them apart)
  learned_positions: bool = False   # max_positions bounds the sequence length
  head_transform: bool = False      # a d_model transform before the vocabulary on scored positions (memory)
  init_cache: Callable | None = None     # (cfg, params, batch, max_length) -> KV cache (decoders)
  decode_step: Callable | None = None    # see layout
  decoder_layers: Callable | None = None  # encoder_decoder: cfg -> layers of the decoder stack (memory)

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
