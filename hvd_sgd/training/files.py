"""The chief's output files: one writability check made before training, and atomic writes."""
import json
import os
import tempfile

from hvd_sgd import JobError


def check_writable(directory, what):
    """Fail before training, not after it, when ``directory`` cannot take ``what`` (a flag and its value)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise JobError(f"{what}: cannot create {directory}: {e.strerror}") from None
    try:  # a file made and removed: os.access says yes to root wherever the mode bits do
        tempfile.TemporaryFile(dir=directory).close()
    except OSError as e:
        raise JobError(f"{what}: cannot write in {directory}: {e.strerror}") from None


def parent(path):
    return os.path.dirname(os.path.abspath(path))


def write_json(path, record):
    write_text(path, json.dumps(record, indent=2))


def write_text(path, text):
    """Written under a temporary name, then renamed: a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
