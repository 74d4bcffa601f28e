"""TFDS datasets made ready to read: a missing dataset is downloaded and prepared in the array_record format (random
access, no TensorFlow) on first use; catalog text builders that only use `tf.io.gfile` (e.g. tiny_shakespeare) build
without TensorFlow. Records are read by data/records.py.
"""
import contextlib
import importlib.util
import sys
import types

from etils import epath


def tfdata_records(builder, split, name):
  """The rows of a split prepared as tfrecord, through tf.data (which needs TensorFlow)."""
  if not have_tensorflow():
    raise ImportError(f"TFDS {name} in {builder.data_dir} is prepared as tfrecord, which needs TensorFlow "
                      "(pip install tensorflow-cpu); or rebuild it with file_format='array_record'")
  import tensorflow_datasets as tfds
  return tfds.as_numpy(builder.as_dataset(split=split, shuffle_files=False))


def prepare_tfds(name: str, data_dir: str = "", manual_dir: str = ""):
  """The TFDS builder of `name`, downloaded and prepared as array_record first if it is not yet.

  Offline, put the files the builder downloads (e.g. tiny_shakespeare's input.txt) in `manual_dir`
  (default <data_dir>/downloads/manual).
  """
  import tensorflow_datasets as tfds
  builder = known_builder(name, data_dir)
  if builder.is_prepared():
    return builder
  config = tfds.download.DownloadConfig(manual_dir=manual_dir or None)
  try:
    with _gfile_without_tensorflow(builder):
      builder.download_and_prepare(file_format="array_record", download_config=config)
  except (ImportError, AttributeError) as e:
    if have_tensorflow():
      raise
    raise ImportError(f"building TFDS {name} needs TensorFlow ({e}); pip install tensorflow-cpu, or prepare "
                      f"it elsewhere with file_format='array_record' into {builder.data_dir}") from e
  return tfds.builder(name, data_dir=data_dir or None)


def known_builder(name: str, data_dir: str = "", origin: str = "config.data.tfds_name"):
  """The TFDS builder of `name` (not prepared), or a one-line ValueError naming its config field, `origin`."""
  import tensorflow_datasets as tfds
  try:
    return tfds.builder(name, data_dir=data_dir or None)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(f"{origin}: unknown TFDS dataset {name!r}") from e


def have_tensorflow() -> bool:
  return importlib.util.find_spec("tensorflow") is not None


@contextlib.contextmanager
def _gfile_without_tensorflow(builder):
  """Serve `tf.io.gfile` with etils.epath while the builder's module builds, when TF is not installed.

  Catalog text builders such as tiny_shakespeare read their download with tf.io.gfile and use nothing
  else of TensorFlow; this lets them build on a TF-free install. Anything else of tf raises AttributeError.
  """
  module = sys.modules[type(builder).__module__]
  if have_tensorflow() or not hasattr(module, "tf"):
    yield
    return
  gfile = types.SimpleNamespace(
      GFile=lambda path, mode="r": epath.Path(path).open(mode),
      exists=lambda path: epath.Path(path).exists(),
      isdir=lambda path: epath.Path(path).is_dir(),
      listdir=lambda path: [p.name for p in epath.Path(path).iterdir()])
  saved = module.tf
  module.tf = types.SimpleNamespace(io=types.SimpleNamespace(gfile=gfile))
  try:
    yield
  finally:
    module.tf = saved
