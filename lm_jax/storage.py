"""The one layer remote paths (gs://... and other fsspec URLs) go through: etils.epath (gcsfs underneath) for
files, google-cloud-storage for what needs object preconditions (the workdir lock), tensorstore (orbax's
checkpoints) reading the same emulator settings. Local paths pass through untouched.

Importing it quiets the storage libraries: gcsfs's experimental bucket-type probe (on by default in gcsfs 2026.x)
asks the Storage Control API for every bucket and, without Application Default Credentials, warns on each
operation; gcsfs logs each failed request with a traceback before raising it, and lm_jax reports the raised error
in one line naming the path. With STORAGE_EMULATOR_HOST (a local GCS server, such as fake-gcs-server in the tests)
tensorstore is pointed at the same server and told that no credentials are needed.
"""
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


def bucket_and_key(url: str) -> tuple[str, str]:
  """'gs://b/a/c' -> ('b', 'a/c')."""
  rest = str(url).split("://", 1)[1]
  bucket, _, key = rest.partition("/")
  return bucket, key


def gcs_blob(url: str):
  """google-cloud-storage Blob of a gs:// URL (anonymous against STORAGE_EMULATOR_HOST)."""
  from google.cloud import storage
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


def upload_dir(local: str, url: str, last: str | None = None):
  """Uploads every file under `local` to the prefix `url`; `last` (a relative name) is uploaded after all the
  others, so a reader that waits for it sees the rest whole."""
  names = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
  if last in names:
    names.remove(last)
    names.append(last)
  root = path(url)
  for name in names:
    target = root / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(open(os.path.join(local, name), "rb").read())


@contextlib.contextmanager
def local_copy(url: str):
  """A local directory holding the files under `url` for the block (the path itself when local)."""
  if not is_remote(url):
    yield str(url)
    return
  root = path(url)
  tmp = tempfile.mkdtemp(prefix="lm_jax-download-")
  try:
    for f in root.rglob("*"):
      if f.is_file():
        dest = os.path.join(tmp, str(f.relative_to(root)))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with open(dest, "wb") as out:
          out.write(f.read_bytes())
    yield tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _fs(url: str):
  import fsspec
  if str(url).startswith("gs://"):
    path(url)   # gcsfs installed, or one line
  return fsspec.core.url_to_fs(str(url))[0]


def list_files(url: str) -> list[str]:
  """URLs of the files directly under the prefix `url`, read fresh from the server (no listing cache)."""
  fs = _fs(url)
  fs.invalidate_cache(str(url))
  scheme = str(url).split("://", 1)[0]
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
  scheme = str(urls[0]).split("://", 1)[0]
  return {u if "://" in u else f"{scheme}://{u}": v for u, v in fs.cat(list(urls)).items()}


def remove(urls: list[str]):
  """Deletes remote files (missing ones are not an error)."""
  if urls:
    try:
      _fs(urls[0]).rm(list(urls))
    except FileNotFoundError:
      pass
