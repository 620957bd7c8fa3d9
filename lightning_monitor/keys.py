r"""The names the monitor logs its figures under, made safe for every Lightning logger.

Loggers that store a key as a file path (MLflow's file store, Neptune's namespaces, W&B panel sections) cannot hold
both ``X`` and ``X/...``: no key the monitor logs is a path prefix of another. The total gradient norm is
``grad_norm`` (``grad_norm_opt<i>`` with several optimizers); the per-layer norms live under their own prefix,
``grad_norm_layers/<layer>`` (``grad_norm_layers_opt<i>/<layer>``). A layer name comes from module paths, which may
hold any character but ``.``: every character outside ``[A-Za-z0-9_.-]`` becomes ``_`` (MLflow allows
``[\w/.\- :]``, and Lightning's ``MLFlowLogger`` strips anything outside ASCII), so a layer never adds a ``/``.

Nothing here needs torch: the report reads these names too.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

__all__ = [
    "ALERTS_PREFIX",
    "GRAD_NORM",
    "GRAD_NORM_LAYERS",
    "MAX_KEY_LENGTH",
    "RENAMED_PREFIX",
    "UPDATE_RATIO",
    "UPDATE_RATIO_LAYERS",
    "WEIGHT_NORM",
    "WEIGHT_NORM_LAYERS",
    "is_layer_key",
    "layer_keys",
    "path_prefix_clashes",
    "total_key",
]

#: The total gradient norm.
GRAD_NORM = "grad_norm"
#: The prefix of the per-layer gradient norms.
GRAD_NORM_LAYERS = "grad_norm_layers"
#: The total weight norm, and the prefix of the per-layer ones (``weight_norms=True``).
WEIGHT_NORM = "weight_norm"
WEIGHT_NORM_LAYERS = "weight_norm_layers"
#: The update-to-weight ratio of the step before a logging step, in total and per layer (``weight_norms=True``).
UPDATE_RATIO = "update_ratio"
UPDATE_RATIO_LAYERS = "update_ratio_layers"
#: The prefix of the alert counters, ``alerts/<kind>``.
ALERTS_PREFIX = "alerts/"
#: The prefix a figure of the monitor's goes out with where the run logs a figure of that name itself
#: (``monitor/grad_norm`` beside the module's own ``self.log("grad_norm", ...)``).
RENAMED_PREFIX = "monitor/"
#: The longest key MLflow takes (``MAX_ENTITY_KEY_LENGTH``); a longer layer key is cut and given a hash.
MAX_KEY_LENGTH = 250

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
# A per-layer key, as logged now or by earlier versions (`grad_norm/<layer>`, `grad_norm_opt<i>/<layer>`).
_LAYER_KEY = re.compile(r"grad_norm(_layers)?(_opt\d+)?/.+")


def total_key(suffix: str = "", name: str = GRAD_NORM) -> str:
    """The key of an optimizer's total ``name`` (the gradient norm); ``suffix`` is ``""`` or ``"_opt<i>"``.

    Example:
        >>> total_key(), total_key("_opt1"), total_key("_opt1", WEIGHT_NORM)
        ('grad_norm', 'grad_norm_opt1', 'weight_norm_opt1')
    """
    return f"{name}{suffix}"


def layer_keys(names: Iterable[str], suffix: str = "", prefix: str = GRAD_NORM_LAYERS) -> list[str]:
    """The keys of the per-layer figures of ``names`` under ``prefix``, in order, distinct and safe for every logger.

    Example:
        >>> layer_keys(["model.layers.0", "heads/a b", "heads_a_b"], "_opt1")
        ['grad_norm_layers_opt1/model.layers.0', 'grad_norm_layers_opt1/heads_a_b', 'grad_norm_layers_opt1/heads_a_b_2']
        >>> layer_keys(["fc"], prefix=UPDATE_RATIO_LAYERS)
        ['update_ratio_layers/fc']
    """
    prefix = f"{prefix}{suffix}/"
    keys: list[str] = []
    taken: set[str] = set()
    for name in names:
        part = _UNSAFE.sub("_", name)
        if not part.strip("."):  # "", "." or "..": a path would resolve to another name
            part = part.replace(".", "_") or "_"
        key = prefix + part
        if len(key) > MAX_KEY_LENGTH:
            digest = hashlib.sha1(name.encode("utf-8")).hexdigest()[:8]
            key = f"{key[: MAX_KEY_LENGTH - 9]}_{digest}"
        base, n = key, 2
        while key in taken:  # two module paths that differ only in replaced characters
            key = f"{base}_{n}"
            n += 1
        taken.add(key)
        keys.append(key)
    return keys


def is_layer_key(key: str) -> bool:
    """Whether ``key`` is a per-layer gradient norm, as logged now or by earlier versions (``grad_norm/<layer>``).

    Example:
        >>> [is_layer_key(k) for k in ("grad_norm_layers/fc", "grad_norm/fc", "grad_norm_opt1/fc", "grad_norm")]
        [True, True, True, False]
    """
    return _LAYER_KEY.fullmatch(key) is not None


def path_prefix_clashes(keys: Iterable[str]) -> list[tuple[str, str]]:
    """The pairs ``(X, X/...)`` among ``keys``: a key that a logger storing keys as paths cannot hold with another.

    Example:
        >>> path_prefix_clashes(["grad_norm", "grad_norm/fc", "grad_norm_layers/fc", "alerts/nonfinite_loss"])
        [('grad_norm', 'grad_norm/fc')]
    """
    unique = set(keys)
    return sorted((key[:i], key) for key in unique for i, c in enumerate(key) if c == "/" and key[:i] in unique)
