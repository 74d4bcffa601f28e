"""The one layer remote paths (gs://... and other fsspec URLs) go through: etils.epath (gcsfs underneath) for
files, google-cloud-storage for what needs object preconditions (the workdir lock), tensorstore (orbax's
checkpoints) reading the same emulator settings. Local paths pass through untouched; the data readers' helpers
(glob, open, isdir, isfile, exists, getsize, version) take either and give local ones to the os / builtins calls
they used before.

Importing it quiets the storage libraries: gcsfs's experimental bucket-type probe (on by default in gcsfs 2026.x)
asks the Storage Control API for every bucket and, without Application Default Credentials, warns on each
operation; gcsfs logs each failed request with a traceback before raising it, and lm_jax reports the raised error
in one line naming the path; google-auth warns of each place it found no credentials, and lm_jax says so in one
line (_check_credentials). With STORAGE_EMULATOR_HOST (a local GCS server, such as fake-gcs-server in the tests)
tensorstore is pointed at the same server and told that no credentials are needed.
"""
import atexit
import builtins
import contextlib
import errno
import glob as glob_lib
import importlib
import logging
import os
import posixpath
import shutil
import sys
import tempfile
import threading

from etils import epath

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")   # read when gcsfs is imported
if os.environ.get("STORAGE_EMULATOR_HOST"):
  os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", os.environ["STORAGE_EMULATOR_HOST"])
  os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")   # tensorstore: no credential search
for _name in ("gcsfs", "fsspec"):
  logging.getLogger(_name).setLevel(logging.CRITICAL)
logging.getLogger("google.auth._default").setLevel(logging.ERROR)   # a warning per place it found no credentials


class StorageError(OSError):
  """A remote path that cannot be used; its message is one line naming the path."""


class Unreachable(StorageError):
  """The storage stopped answering mid-run (a checkpoint save whose retries ran out). The command line then exits
  right after its one line (exit_at_once): tensorboardX's exit-time upload would retry for two minutes more and print
  a 40-line traceback, for events that cannot be written anyway. The warnings held (hold) are folded into the line."""

  def __init__(self, message: str):
    with _HELD_LOCK:
      held = list(_HELD)
      for timer in _HELD.values():
        timer.cancel()
      _HELD.clear()
    super().__init__(message + (f" (before it: {'; '.join(held)})" if held else ""))


_HELD, _HELD_LOCK = {}, threading.Lock()   # warning -> the timer that prints it (hold)
_HOLD_S = None                             # how long hold keeps a warning; None: not a gs:// run


def bound_upload_retries(seconds: float):
  """google-cloud-storage's default retry (tensorboardX's uploads of a gs:// workdir's TensorBoard events use it)
  given up after `seconds`, 120 s at most (its own limit): with the server gone, each TensorBoard flush of the
  training loop waited 120 s, whatever storage_retry_s said. Warnings about the workdir's storage are held (hold)
  for `seconds` + 120 s."""
  global _HOLD_S
  from google.cloud.storage import retry
  retry.DEFAULT_RETRY._timeout = retry.DEFAULT_RETRY._deadline = min(120.0, seconds)   # bound as its default
  _HOLD_S = seconds + 120   # the save's retries, then the steps to the next save that reports them


def hold(message: str) -> bool:
  """Holds back a warning about a gs:// workdir's storage (the lock, metrics.jsonl, TensorBoard failing): printed
  as 'warning: ...' after _HOLD_S, or at exit, unless a save fails first with Unreachable, whose one line then names
  it. With the server gone they all fail within seconds of that save: one line, not four. False (print it now)
  outside a gs:// run."""
  if _HOLD_S is None:
    return False
  timer = threading.Timer(_HOLD_S, _release, (message,))
  timer.daemon = True
  with _HELD_LOCK:
    if message in _HELD:
      return True
    _HELD[message] = timer
  timer.start()
  return True


def _release(message: str):
  with _HELD_LOCK:
    timer = _HELD.pop(message, None)
  if timer is not None:
    timer.cancel()
    print(f"warning: {message}", file=sys.stderr, flush=True)


@atexit.register
def _release_all():
  """A run that ends before a held warning's time prints it (exit_at_once, after Unreachable's line, skips this)."""
  for message in list(_HELD):
    _release(message)


def exit_at_once(code: int):
  """Ends the process without the rest of the exit handlers (registered last, atexit runs it first)."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def is_remote(path) -> bool:
  return "://" in str(path)


def path(p) -> epath.Path:
  """epath.Path of a local path or URL; gs:// without gcsfs installed, or without credentials -> one line."""
  if str(p).startswith("gs://"):
    try:
      importlib.import_module("gcsfs")
    except ImportError:
      raise StorageError(f"{p}: gs:// paths need gcsfs (pip install -r requirements.txt)") from None
    _check_credentials(p)
  return epath.Path(p)


_CREDENTIALS_FOUND = False


def _check_credentials(url):
  """StorageError naming `url` when gs:// has neither an emulator (STORAGE_EMULATOR_HOST) nor Application Default
  Credentials: without them gcsfs would go on anonymously and fail later, on a bucket that is not public, with
  retries and a traceback. Looked up once per process."""
  global _CREDENTIALS_FOUND
  if _CREDENTIALS_FOUND or os.environ.get("STORAGE_EMULATOR_HOST"):
    return
  import google.auth
  from google.auth import exceptions
  try:
    google.auth.default()
  except exceptions.DefaultCredentialsError:
    raise StorageError(f"{url}: no Google Cloud credentials (run `gcloud auth application-default login`, set "
                       "GOOGLE_APPLICATION_CREDENTIALS, or run on a VM with a service account)") from None
  _CREDENTIALS_FOUND = True


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
  return _client(url).bucket(bucket).blob(key)


_CLIENT = None


def _client(url: str):
  """google-cloud-storage's client, made once; `url` names what it is for in an error."""
  global _CLIENT
  if _CLIENT is None:
    _check_credentials(url)
    from google.cloud import storage
    _CLIENT = storage.Client()
  return _CLIENT


def check_bucket(url: str):
  """StorageError naming the URL when its bucket does not exist or cannot be reached."""
  if not str(url).startswith("gs://"):
    return
  bucket = bucket_and_key(url)[0]
  try:
    exists = _client(url).bucket(bucket).exists()
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


def normalized(url: str) -> str:
  """`url` with '.', '..', repeated and trailing slashes of its key resolved ('gs://b/x/../run/' -> 'gs://b/run'):
  the spelling that guards compare, however a user wrote it."""
  scheme, rest = str(url).split("://", 1)
  bucket, _, key = rest.partition("/")
  key = posixpath.normpath("/" + key).lstrip("/")
  return f"{scheme}://{bucket}/{key}" if key else f"{scheme}://{bucket}"


def within(url: str, folder: str) -> bool:
  """Whether the prefix `url` is `folder` or inside it, both normalized, as raw and as resolved spellings (a storage
  may take 'a/../b' literally or resolve it: a guard holds for either)."""
  pairs = ((str(url).rstrip("/"), str(folder).rstrip("/")), (normalized(url), normalized(folder)))
  return any(u == f or u.startswith(f + "/") for u, f in pairs)


def entries(url: str) -> list[str]:
  """Names of the files and folders directly under the prefix `url`, read fresh from the server ([] when none)."""
  fs = _fs(url)
  fs.invalidate_cache(str(url))
  try:
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in _remote(url, fs.ls, str(url), detail=True))
  except FileNotFoundError:
    return []


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


def local_file(url: str) -> str:
  """A local copy of one remote file, made once per process (the path itself when local)."""
  if not is_remote(url):
    return str(url)
  if url not in _DOWNLOADS:
    tmp = tempfile.mkdtemp(prefix="lm_jax-download-")
    atexit.register(shutil.rmtree, tmp, True)
    dest = os.path.join(tmp, str(url).rsplit("/", 1)[1])
    _remote(url, _fs(url).get_file, str(url), dest)
    _DOWNLOADS[url] = dest
  return _DOWNLOADS[url]


def _fs(url: str):
  import fsspec
  if str(url).startswith("gs://"):
    path(url)   # gcsfs installed, or one line
  return fsspec.core.url_to_fs(str(url))[0]


def forget_listings(url: str):
  """Drops this process's cached listings of `url`'s storage. orbax and etils list a bucket through fsspec instances
  of their own, which keep every listing until told otherwise: a reader beside a trainer would go on seeing the steps
  that the trainer has deleted since (and miss the ones it saved). Every instance of the scheme is told, as a listing
  of a folder caches its subfolders' too. Local paths have no cache."""
  if is_remote(url):
    import fsspec
    for fs in list(fsspec.get_filesystem_class(_scheme(url))._cache.values()):   # fsspec's live instances
      fs.invalidate_cache()


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


# ------------------------------------------------------------------------------- data files, local or remote
def glob(pattern: str) -> list[str]:
  """The sorted matches of a glob ('**' spans folders): local ones as glob.glob gives them, remote ones as URLs read
  fresh from the server."""
  if not is_remote(pattern):
    return sorted(glob_lib.glob(pattern, recursive=True))
  fs = _fs(pattern)
  fs.invalidate_cache()
  try:
    found = _remote(pattern, fs.glob, pattern)
  except FileNotFoundError:
    found = []
  if not found:   # a missing bucket is said so, rather than as a glob matching nothing
    check_bucket(pattern)
  return sorted(f"{_scheme(pattern)}://{p}" for p in found)


def open(p, mode: str = "rb", **kwargs):
  """A file object of a local path (builtins.open) or a URL (fsspec, read in blocks as it is consumed)."""
  if not is_remote(p):
    return builtins.open(p, mode, **kwargs)
  return _remote(p, _fs(p).open, str(p), mode, **kwargs)


def isdir(p) -> bool:
  """A local folder, or a remote prefix with objects under it."""
  return os.path.isdir(p) if not is_remote(p) else _remote(p, _fs(p).isdir, str(p))


def isfile(p) -> bool:
  return os.path.isfile(p) if not is_remote(p) else _remote(p, _fs(p).isfile, str(p))


def exists(p) -> bool:
  return os.path.exists(p) if not is_remote(p) else _remote(p, _fs(p).exists, str(p))


def getsize(p) -> int:
  return os.path.getsize(p) if not is_remote(p) else _remote(p, _fs(p).size, str(p))


def version(p) -> list:
  """What changes when the file does: [absolute path, size, modification time in ns] of a local file, [URL, size,
  generation (else ETag)] of a remote one."""
  if not is_remote(p):
    stat = os.stat(p)
    return [os.path.abspath(p), stat.st_size, stat.st_mtime_ns]
  info = _remote(p, _fs(p).info, str(p))
  return [str(p), info["size"], info.get("generation") or info.get("etag") or info.get("updated")]


def _remote(url, call, *args, **kwargs):
  """call(*args, **kwargs) of a remote file system; what the server refuses or fails is a StorageError naming
  `url` in one line (a missing file stays a FileNotFoundError)."""
  try:
    return call(*args, **kwargs)
  except FileNotFoundError:   # gcsfs names the API's path ('b/bucket/o/key'): named here as open() would
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(url)) from None
  except StorageError:
    raise
  except Exception as e:  # noqa: BLE001  (gcsfs: OSError 'Forbidden', HttpError, requests' and google.auth's own)
    why = "permission denied" if describe(e).startswith("Forbidden") else describe(e)
    raise StorageError(f"{url}: {why}") from None


# ------------------------------------------------------------------------------- writing in a user's folder
def refuse_link(p):
  """StorageError naming `p` when it is a symbolic link: lm_jax never creates or appends a file through a link placed
  in a folder the user names (it could overwrite the link's target). Reading through links stays."""
  if not is_remote(p) and os.path.islink(p):
    refuse_links([p])


def refuse_links(paths: list[str]):
  """refuse_link's error naming every one of `paths` (links), if any."""
  if paths:
    are = "is a symbolic link" if len(paths) == 1 else "are symbolic links"
    raise StorageError(f"{', '.join(map(str, paths))} {are}; lm_jax does not write through links: remove "
                       f"{'it' if len(paths) == 1 else 'them'}")


def open_append(p: str):
  """A local file opened to append (created if missing), never through a link (refuse_link's error)."""
  try:
    return os.fdopen(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644), "a")
  except OSError as e:
    if e.errno == errno.ELOOP:
      refuse_link(p)
    raise


def write_new(folder: str, prefix: str, data: bytes) -> str:
  """The path of a new file in a local folder holding `data`, under a name no other file had (O_EXCL: never a link
  placed there), for writing a file whole and renaming it over its final name."""
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=prefix, suffix=".tmp")
  os.fchmod(fd, 0o644)   # as an ordinary new file (mkstemp's is 0600)
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  return tmp


_URL_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~/")


def url_unsafe(url: str) -> str:
  """The characters of a remote path other than a URL's unreserved ones and '/': TensorStore (orbax's checkpoints)
  parses a gs:// path as a URL ('#', '?' refused, '%41' read as 'A': data outside the folder) and gcsfs's renames
  expand '*' and '[]' as globs, so such a name puts files elsewhere or stops a run part way. '' for a local path."""
  if not is_remote(url):
    return ""
  return "".join(sorted(set(str(url).split("://", 1)[1]) - _URL_SAFE))
