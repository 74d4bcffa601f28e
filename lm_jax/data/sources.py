"""Pre-training text: the documents of config.data (its files, or TFDS dataset tfds_name), or of one source of
config.data.mixture (data/mixture.py), through the one record reader (lm_jax/data/records.py: formats, split names
and slices, bad records, invalid UTF-8).

`documents(config, split)` returns a random-access sequence; item i is the text of document i (config.data.text_field
of a .jsonl / .tsv record or a TFDS feature; a .txt document), or a `records.Bad` for a record that is not usable
text (counted and skipped by the pipeline, never fatal).

config.data.files without {split} (one file, or one glob, for every split) would give the eval the training text:
its documents are cut instead, the first data.split_fraction (default 0.9) training and the rest evaluating. A
data.mixture source's files without {split} are cut the same way.
"""
import functools
import multiprocessing

from lm_jax import distributed
from lm_jax.data import mixture as mixture_lib
from lm_jax.data import records, tfds_prepare

DEFAULT_FRACTION = 0.9        # nanoGPT's split of one file (data/shakespeare_char/prepare.py)


def documents(config, split: str, source: mixture_lib.Source | None = None) -> records.Records:
  """The documents of `split` (e.g. config.data.train_split) from config.data.files or TFDS, or from `source`."""
  d = config.data
  if source is not None:
    if source.tfds_name:      # an unknown name is an error naming the source's field, not config.data.tfds_name
      tfds_prepare.known_builder(source.tfds_name, d.tfds_data_dir, f"{source.field}.tfds_name")
    docs = records.read(split, source.text_field, files=source.files, tfds_name=source.tfds_name,
                        tfds_data_dir=d.tfds_data_dir, documents=True,
                        origin=f"{source.field}.{'files' if source.files else 'tfds_name'}",
                        named_by=f"{source.field}.text_field")
    return _held_out(config, split, docs, source)
  if not d.files and not d.tfds_name:
    raise ValueError("config.data: set files (a glob of your text), tfds_name (a TFDS dataset) or mixture (several)")
  docs = records.read(split, d.text_field, files=d.files, tfds_name=d.tfds_name, tfds_data_dir=d.tfds_data_dir,
                      documents=True, origin="config.data.files" if d.files else "config.data.tfds_name",
                      named_by="config.data.text_field")
  return _held_out(config, split, docs)


def _held_out(config, split: str, docs: records.Records, source=None) -> records.Records:
  """docs, or its first _train_fraction (the train split) or the rest (the eval split) when every split of
  config.data or of `source` (a mixture source) reads the same files."""
  s, name = (source, f"{source.field}.files ({source.name})") if source else (config.data, "data.files")
  fraction = _train_fraction(config, split, source)
  if not fraction:
    return docs
  cut = int(len(docs) * fraction)
  if not 0 < cut < len(docs):
    _say_once(f"data: {name} has no {{split}} and {len(docs)} document(s), too few to hold out an eval: it "
              "evaluates on the training text (name a file per split with {split}, or separate documents by blank "
              "lines)")
    return docs
  if not config.data.split_fraction:
    _say_once(f"data: {name} has no {{split}}: training on the first {fraction:.0%} of its documents, evaluating "
              f"on the last {1 - fraction:.0%} (data.split_fraction sets the cut)")
  return docs.sliced((str(cut), "") if split == s.eval_split != s.train_split else ("", str(cut)))


def _train_fraction(config, split: str, source=None) -> float:
  """The first fraction of the documents of config.data or of `source` (a mixture source) that trains, the rest
  evaluating, when every split reads the same files (no {split} in its files, no slice in `split` or its split names:
  a slice picks the records itself): data.split_fraction, else DEFAULT_FRACTION. 0 when the splits are the files'
  own, or TFDS's, or when train_split and eval_split name one split (an eval on the training text asked for)."""
  d = config.data
  s = source or d
  one = bool(s.files) and "{split}" not in s.files and s.train_split != s.eval_split
  if d.split_fraction:
    if not 0 < d.split_fraction < 1:
      raise ValueError(f"config.data.split_fraction={d.split_fraction} must be in (0, 1) (0 = the default)")
    texts = [x.files for x in mixture_lib.sources(config) or [d] if x.files and "{split}" not in x.files]
    if not texts:
      raise ValueError(f"config.data.split_fraction cuts one text: set config.data.files to its file(s) without "
                       f"{{split}}, got {d.files!r}")
    if source is None:
      return d.split_fraction
  sliced = any(records.split_spec(name)[1] for name in (split, s.train_split, s.eval_split))
  return (d.split_fraction or DEFAULT_FRACTION) if one and not sliced else 0.0


def held_out(config) -> str:
  """The held-out rule of the training text ('' when every split reads its own files), kept in the data iterator's
  checkpointed state so that a run resumed under another rule says so (resumed_with)."""
  rules = []
  for name, source in [(f"{s.field}.files", s) for s in mixture_lib.sources(config)] or [("data.files", None)]:
    fraction = _train_fraction(config, (source or config.data).train_split, source)
    if fraction:
      rules.append(f"{name}: the first {fraction:.0%} of its documents train, the rest evaluate")
  return "; ".join(rules)


def resumed_with(saved: str, now: str):
  """One console line when the checkpoint's held-out rule (`saved`; '' in one made before lm_jax kept it) is not
  this run's (`now`): the evals before and after the resume read different text."""
  if saved != now:
    before = f"with {saved}" if saved else ("before files without {split} held out an eval (its evals read the "
                                            "training text)")
    _say_once(f"data: resumed from a checkpoint made {before}; now {now or 'no split is held out'}: evals before "
              "and after this resume read different text")


@functools.cache
def _say_once(line: str):
  """A console line about the data, once per process (the tokenizer, train and eval streams all read it), from the
  lead process only (not from data.workers or lm_jax.prepare's worker processes)."""
  if distributed.is_lead() and multiprocessing.parent_process() is None:
    print(line, flush=True)


def training_text(config, max_chars: int) -> list[str]:
  """Lines of an evenly spaced sample of the training documents, max_chars in all (the same on every host).

  A mixture's sample takes from each source its weight's share of max_chars, so the tokenizer learns the text in
  the proportions the model trains on. Lines are whole however long (tokenizer.train cuts them to SentencePiece's
  sentence limit).
  """
  mixture = mixture_lib.sources(config)
  if not mixture:
    return _sample(documents(config, config.data.train_split), max_chars)
  shares = mixture_lib.weights(mixture)
  return [line for s, share in zip(mixture, shares)
          for line in _sample(documents(config, s.train_split, s), max(1, int(share * max_chars)))]


def _sample(docs: records.Records, max_chars: int) -> list[str]:
  step = max(1, len(docs) // 20_000)
  lines, total = [], 0
  for i in range(0, len(docs), step):
    text = docs[i]
    if isinstance(text, records.Bad):
      continue
    for line in text.splitlines():
      if line.strip() and total < max_chars:
        lines.append(line[:max_chars - total])
        total += len(lines[-1])
    if total >= max_chars:
      break
  if not lines:
    raise ValueError(f"no text to train a tokenizer on in {docs.path}")
  return lines
