"""This user's checkpoint key: the secret that seals the manifests of disk checkpoints, so
that a checkpoint this user did not write (planted by another user, with checksums
recomputed to match) is refused when loaded.

Disk checkpoints outlive the pool that saved them (and the machine's uptime), so the key
cannot be a pool's: it is the user's own, kept where only the user reaches:

* ``$FSDPI_CHECKPOINT_KEY`` (hex digits) when set: a pool sets it, from the kernel's key,
  in every rank's environment (never on a command line), so that ranks on hosts that do
  not share the user's home hold the same key; set it yourself for ranks started by
  another launcher on hosts without a shared home;
* else the file ``checkpoint.key`` in the private folder ``fsdp-interactive`` of the
  user's configuration folder (``$XDG_CONFIG_HOME``, else ``~/.config``): folder mode
  0700, file mode 0600, made on first use with ``O_EXCL | O_NOFOLLOW``
  (:func:`fsdp_interactive._private_files.key_file`). A folder or file there that is not
  the user's alone (another user's, a link, readable by others) is refused, naming it.

Losing the key (a new home, a removed file) does not lose a checkpoint: its data and
checksums are all there; ``fsdp_interactive.checkpoint.trust(path)`` seals it with the new
key once the user says it is theirs. Standard library only: the kernel reads the key for
its pool without importing torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from fsdp_interactive import _private_files

#: The environment variable that carries the key (hex) to the ranks of a pool.
KEY_ENV = "FSDPI_CHECKPOINT_KEY"
FOLDER_NAME = "fsdp-interactive"
KEY_FILE = "checkpoint.key"


class OwnerKeyError(PermissionError):
    """The key cannot be read or made: the message names the variable, folder or file and
    what to do."""


def key_folder() -> Path:
    """``$XDG_CONFIG_HOME/fsdp-interactive`` (``~/.config/fsdp-interactive`` without it)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / FOLDER_NAME


def owner_key() -> bytes:
    """This user's checkpoint key (see the module); made on first use."""
    text = os.environ.get(KEY_ENV)
    if text:
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise OwnerKeyError(
                f"${KEY_ENV} must be a key in hex digits (a pool sets it from "
                f"{key_folder() / KEY_FILE})"
            ) from None
    folder = key_folder()
    try:
        if not folder.parent.exists():
            folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _private_files.make_private_folder(folder, exist_ok=True)
        text_bytes = _private_files.key_file(folder, KEY_FILE)
    except _private_files.NotPrivateError as exc:
        raise OwnerKeyError(
            f"refusing the checkpoint key at {exc.path}: it {exc.reason}. The key must be "
            f"this user's alone (folder mode 0700, file mode 0600): remove what is there if "
            f"it is not yours, or set ${KEY_ENV}"
        ) from None
    except OSError as exc:
        raise OwnerKeyError(
            f"cannot read or make the checkpoint key in {folder} ({exc}); set "
            f"$XDG_CONFIG_HOME to a folder of yours, or ${KEY_ENV}"
        ) from None
    try:
        return bytes.fromhex(text_bytes.decode())
    except ValueError:
        raise OwnerKeyError(
            f"{folder / KEY_FILE} is not a checkpoint key (hex digits): remove it (checkpoints "
            "it sealed can be sealed again with fsdp_interactive.checkpoint.trust)"
        ) from None


def key_hex() -> str:
    """:func:`owner_key` as hex, what :data:`KEY_ENV` carries."""
    return owner_key().hex()


def fingerprint(key: bytes) -> str:
    """A short value that tells whether two ranks hold the same key, without showing it."""
    return hmac.new(
        key, b"fsdp-interactive checkpoint key fingerprint", hashlib.sha256
    ).hexdigest()[:16]
