"""Pre-training text: the documents of config.data (its files, or TFDS dataset tfds_name) through the one record
reader (lm_jax/data/records.py: formats, split names and slices, bad records, invalid UTF-8).

`documents(config, split)` returns a random-access sequence; item i is the text of document i (config.data.text_field
of a .jsonl / .tsv record or a TFDS feature; a .txt document), or a `records.Bad` for a record that is not usable
text (counted and skipped by the pipeline, never fatal).
"""
from lm_jax.data import records


def documents(config, split: str) -> records.Records:
  """The documents of `split` (e.g. config.data.train_split) from config.data.files or TFDS."""
  d = config.data
  if not d.files and not d.tfds_name:
    raise ValueError("config.data: set files (a glob of your text) or tfds_name (a TFDS dataset)")
  return records.read(split, d.text_field, files=d.files, tfds_name=d.tfds_name, tfds_data_dir=d.tfds_data_dir,
                      documents=True, origin="config.data.files" if d.files else "config.data.tfds_name",
                      named_by="config.data.text_field")


def training_text(config, max_chars: int) -> list[str]:
  """Lines of an evenly spaced sample of the training documents, max_chars in all (the same on every host).

  Lines are whole however long (tokenizer.train cuts them to SentencePiece's sentence limit).
  """
  docs = documents(config, config.data.train_split)
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
