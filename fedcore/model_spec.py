"""How a run names its model, torch-free (the flags are checked with this before torch loads): a zoo name
(``fedavgcnn``), ``MODULE:FUNCTION`` (an importable module) or ``PATH.py:FUNCTION`` (a file anywhere).

The spec string is what travels: into the run's settings (a resume must name the same model), to the simulator's
worker processes, to ``export`` and the benchmarks. A file's path is made absolute when the flag is read, so every
process that rebuilds the model finds the same file whatever its working directory. ``fedcore.models.load_model``
builds the model a spec names.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass

ZOO_KIND, MODULE_KIND, FILE_KIND = "zoo", "module", "file"
FILE_SUFFIX = ".py"
FILE_MODULE_PREFIX = "fedara_user_model_"
"""A model file is imported as this plus a hash of its absolute path: the same name in every process, so the
classes it defines pickle (the simulator's workers import the file under that name before they unpickle)."""


@dataclass(frozen=True)
class ModelSpec:
    """A parsed ``--model`` value: its kind, where the code is (a zoo name, a module, an absolute file) and the
    function that builds it (None for the zoo)."""

    text: str
    kind: str
    source: str
    function: str | None = None

    @property
    def is_zoo(self) -> bool:
        return self.kind == ZOO_KIND

    @property
    def module_name(self) -> str:
        """The name the model's code is imported under."""
        if self.kind == FILE_KIND:
            return FILE_MODULE_PREFIX + hashlib.sha256(self.source.encode()).hexdigest()[:16]
        return self.source


def absolute_spec(text: str) -> str:
    """``text`` with a model file's path made absolute (every other spec unchanged): the flag's type."""
    source, colon, function = text.rpartition(":")
    if colon and source.endswith(FILE_SUFFIX) and not os.path.isabs(source):
        return f"{os.path.abspath(source)}:{function}"
    return text


def parse_model_spec(text: str, zoo: tuple[str, ...]) -> ModelSpec:
    """The spec ``text`` names; raises ValueError (naming --model, the value and the fix) for a zoo name that is
    not one, a missing file, a module that cannot be found or a function that is not an identifier."""
    if ":" not in text:
        if text in zoo:
            return ModelSpec(text, ZOO_KIND, text)
        raise ValueError(f"--model {text!r} is not a zoo model ({', '.join(zoo)}); name your own as "
                         "MODULE:FUNCTION or PATH.py:FUNCTION (see docs/your_model.md)")
    source, _, function = text.rpartition(":")
    if not function.isidentifier():
        raise ValueError(f"--model {text!r}: {function!r} is not a function name; write PATH.py:FUNCTION or "
                         "MODULE:FUNCTION")
    if source.endswith(FILE_SUFFIX):
        path = os.path.abspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"--model {text!r}: no file {path}; give the path of your model file")
        return ModelSpec(text, FILE_KIND, path, function)
    if not all(part.isidentifier() for part in source.split(".")):
        raise ValueError(f"--model {text!r}: {source!r} is neither a module name nor a .py file")
    try:
        found = importlib.util.find_spec(source)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"--model {text!r}: no module {source!r} on the Python path; install it, or give its file "
                         "as PATH.py:FUNCTION")
    return ModelSpec(text, MODULE_KIND, source, function)
