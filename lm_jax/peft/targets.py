"""Which Dense kernels an adapter method targets, and where they sit: the part every method (lora.py, ia3.py) and
the PEFT format share. A method's config group (config.lora, config.ia3) has `targets` (regexes over looped
kernel paths, e.g. 'layers_0/attention/query/kernel') and `modules_to_save` (regexes over param paths that train
fully beside the adapters); a kernel that trains fully is never adapted."""
import re

from lm_jax import models
from lm_jax.models import layers


def n_in(spec) -> int:
  """Input dims of a Dense kernel: the attention output projection contracts (heads, kv); every other one dim."""
  return 2 if tuple(spec[:2]) == ("heads", "kv") else 1


def trains_fully(group, path: str) -> bool:
  return any(re.search(rx, path) for rx in group.modules_to_save)


def kernels(config, group) -> list[str]:
  """Looped paths of the Dense kernels group.targets matches, in model order."""
  shapes, _ = models.looped_params(config.model)
  return [p for p in shapes if p.endswith("/kernel") and not trains_fully(group, p)
          and any(re.search(rx, p) for rx in group.targets)]


def placed(config, looped: str) -> tuple[tuple[str, ...], int]:
  """(path in the run's layout, index along its leading layer axis; 0 outside a scanned stack): where the family
  places each looped layer (Family.place_layer: a scanned stack keeps all its layers under 'layers', ModernBERT's
  groups under 'layers/<sub-layer>')."""
  place_layer, path, index = models.family(config.model).place_layer, [], 0
  for k in looped.split("/"):
    m = layers.LOOPED.fullmatch(k)
    where = place_layer(config.model, int(m[1])) if m else None
    path += where[0] if where else [k]
    index = where[1] if where else index
  return tuple(path), index


def run_path(config, looped: str) -> tuple[str, ...]:
  return placed(config, looped)[0]


def groups(config, group) -> dict:
  """{run-layout kernel path: [looped kernel paths, in the order of its leading layer axis]}."""
  out = {}
  for p in kernels(config, group):
    out.setdefault(run_path(config, p), []).append(p)
  return {path: sorted(members, key=lambda p: placed(config, p)[1]) for path, members in out.items()}


def adapted(config, group) -> list[tuple[str, ...]]:
  """Run-layout paths of the Dense modules whose kernels group.targets matches."""
  return [p[:-1] for p in groups(config, group)]


def lead(run_path, members) -> tuple[tuple, tuple]:
  """(shape, logical spec) of the leading layer axis of a scanned stack's adapters: ((n,), ('layers',)) or ((), ())."""
  return ((len(members),), ("layers",)) if "layers" in run_path else ((), ())


def put(tree: dict, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def overlay(tree: dict, new: dict) -> dict:
  """`tree` with the leaves of `new` put in (new subtrees added)."""
  out = dict(tree)
  for k, v in new.items():
    out[k] = overlay(tree[k], v) if isinstance(v, dict) and k in tree else v
  return out


def check(config, name: str):
  """One-line ValueErrors naming config.<name>.targets / modules_to_save that cannot apply to config.model."""
  group = config[name]
  for field in ("targets", "modules_to_save"):
    for rx in group[field]:
      try:
        re.compile(rx)
      except re.error as e:
        raise ValueError(f"config.{name}.{field}: {rx!r} is not a regular expression ({e})") from None
  shapes, _ = models.looped_params(config.model)
  found = [p for p in shapes if p.endswith("/kernel")]
  for rx in group.targets:
    if not any(re.search(rx, p) for p in found):
      raise ValueError(f"config.{name}.targets: {rx!r} matches no Dense kernel (paths look like {found[0]!r}, "
                       f"{next((p for p in found if 'layers_' in p), found[-1])!r})")
  if not group.targets:
    raise ValueError(f"config.{name}.targets is empty: name the kernels to adapt, e.g. ('attention/(query|value)/',)")
  for path, members in groups(config, group).items():
    if config.model.scan_layers and "layers" in path:
      stack = [p for p in found if run_path(config, p) == path]
      if len(members) != len(stack):
        raise ValueError(f"config.{name}.targets={tuple(group.targets)!r} adapts some layers of a scanned stack "
                         f"({'/'.join(path)}); set config.model.scan_layers=False")


def saved_mask(config, name: str, tree: dict) -> dict:
  """Bool tree over the run's plain params `tree`: True for config.<name>.modules_to_save."""
  group = config[name]

  def trains(path):
    if "layers" not in path:
      return trains_fully(group, "/".join(path))
    looped = [p for p in models.looped_params(config.model)[0] if run_path(config, p)[:len(path)] == path]
    found = {trains_fully(group, p) for p in looped}
    if len(found) > 1:
      raise ValueError(f"config.{name}.modules_to_save={tuple(group.modules_to_save)!r} trains some layers of a "
                       f"scanned stack ({'/'.join(path)}); set config.model.scan_layers=False")
    return found.pop()

  def walk(node, path):
    return {k: walk(v, path + (k,)) for k, v in node.items()} if isinstance(node, dict) else trains(path)
  return walk(tree, ())
