"""The one layer remote paths (gs://... and other fsspec URLs) go through: etils.epath (gcsfs underneath) for
files, google-cloud-storage for what needs object preconditions (the workdir lock), tensorstore (orbax's
checkpoints) reading the same emulator settings. Local paths pass through untouched.

Importing it quiets the storage libraries: gcsfs's experimental bucket-type probe (on by default in gcsfs 2026.x)
asks the Storage Control API for every bucket and, without Application Default Credentials, warns on each
operation; gcsfs logs each failed request with a traceback before raising it, and lm_jax reports the raised error
in one line naming the path. With STORAGE_EMULATOR_HOST (a local GCS server, such as fake-gcs-server in the tests)
tensorstore is pointed at the same server and told that no credentials are needed.
"""
import atexit
import contextlib
import logging
import os
import shutil
import tempfile

from etils import epath

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")   # read when gcsfs is imported
if os.environ.get("STORAGE_EMULATOR_HOST"):
  os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", os.environ["STORAGE_EMULATOR_HOST"])
  os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")   # tensorstore: no credential search
for _name in ("gcsfs", "fsspec"):
  logging.getLogger(_name).setLevel(logging.CRITICAL)


class StorageError(OSError):
  """A remote path that cannot be used; its message is one line naming the path."""


def is_remote(path) -> bool:
  return "://" in str(path)


def path(p) -> epath.Path:
  """epath.Path of a local path or URL; gs:// without gcsfs installed -> one line saying what to install."""
  if str(p).startswith("gs://"):
    try:
      import gcsfs  # noqa: F401
    except ImportError:
      raise StorageError(f"{p}: gs:// paths need gcsfs (pip install -r requirements.txt)") from None
  return epath.Path(p)


def describe(error: BaseException) -> str:
  """A storage library's exception as a short phrase (first line of its message)."""
  text = str(error).strip().splitlines()
  return text[0] if text else type(error).__name__


def _scheme(url) -> str:
  return str(url).split("://", 1)[0]


def bucket_and_key(url: str) -> tuple[str, str]:
  """'gs://b/a/c' -> ('b', 'a/c')."""
  rest = str(url).split("://", 1)[1]
  bucket, _, key = rest.partition("/")
  return bucket, key


def gcs_blob(url: str):
  """google-cloud-storage Blob of a gs:// URL (anonymous against STORAGE_EMULATOR_HOST)."""
  bucket, key = bucket_and_key(url)
  return _client().bucket(bucket).blob(key)


_CLIENT = None


def _client():
  global _CLIENT
  if _CLIENT is None:
    from google.cloud import storage
    _CLIENT = storage.Client()
  return _CLIENT


def check_bucket(url: str):
  """StorageError naming the URL when its bucket does not exist or cannot be reached."""
  if not str(url).startswith("gs://"):
    return
  bucket = bucket_and_key(url)[0]
  try:
    exists = _client().bucket(bucket).exists()
  except Exception as e:  # noqa: BLE001  (auth, network, permission: each its own library's class)
    raise StorageError(f"cannot reach bucket gs://{bucket} for {url}: {describe(e)}") from None
  if not exists:
    raise StorageError(f"bucket gs://{bucket} of {url} does not exist (create it, or fix the path)")


def find(url: str) -> list[str]:
  """URLs of every file under the prefix `url`, read fresh from the server."""
  fs = _fs(url)
  fs.invalidate_cache()
  scheme = _scheme(url)
  return sorted(f"{scheme}://{p}" for p in fs.find(str(url).rstrip("/") + "/"))


def upload_dir(local: str, url: str, last: str):
  """Uploads the files under `local` to the prefix `url` (replacing what is there) so that it is whole once `last`
  (a relative name) exists: an old `last` is deleted first and the new one uploaded after every other file, and an
  error part way removes what was uploaded."""
  names = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
  names.sort(key=lambda n: n == last)   # `last` last
  root, fs = str(url).rstrip("/"), _fs(url)
  old = find(root)
  remove([u for u in old if u == f"{root}/{last}"])
  done = []
  try:
    for name in names:
      fs.put_file(os.path.join(local, name), f"{root}/{name}")
      done.append(f"{root}/{name}")
  except BaseException:
    with contextlib.suppress(Exception):
      remove(done)
    raise
  remove([u for u in old if u not in done])


_DOWNLOADS: dict[str, str] = {}


def local_dir(url: str) -> str:
  """A local copy of the files under `url`, made once per process (the path itself when local): for readers that
  need files on disk (safetensors, tokenizers)."""
  if not is_remote(url):
    return str(url)
  url = str(url).rstrip("/")
  if url not in _DOWNLOADS:
    tmp = tempfile.mkdtemp(prefix="lm_jax-download-")
    atexit.register(shutil.rmtree, tmp, True)
    fs = _fs(url)
    for f in find(url):
      dest = os.path.join(tmp, f[len(url) + 1:])
      os.makedirs(os.path.dirname(dest), exist_ok=True)
      fs.get_file(f, dest)
    _DOWNLOADS[url] = tmp
  return _DOWNLOADS[url]


def _fs(url: str):
  import fsspec
  if str(url).startswith("gs://"):
    path(url)   # gcsfs installed, or one line
  return fsspec.core.url_to_fs(str(url))[0]


def list_files(url: str) -> list[str]:
  """URLs of the files directly under the prefix `url`, read fresh from the server (no listing cache)."""
  fs = _fs(url)
  fs.invalidate_cache(str(url))
  scheme = _scheme(url)
  try:
    entries = fs.ls(str(url), detail=True)
  except FileNotFoundError:
    return []
  return sorted(f"{scheme}://{e['name']}" for e in entries if e["type"] == "file")


def read_many(urls: list[str]) -> dict[str, bytes]:
  """The bytes of many remote files, fetched concurrently (gcsfs: one request each, in parallel)."""
  if not urls:
    return {}
  fs = _fs(urls[0])
  scheme = _scheme(urls[0])
  return {u if "://" in u else f"{scheme}://{u}": v for u, v in fs.cat(list(urls)).items()}


def remove(urls: list[str]):
  """Deletes remote files (missing ones are not an error)."""
  if urls:
    try:
      _fs(urls[0]).rm(list(urls))
    except FileNotFoundError:
      pass
