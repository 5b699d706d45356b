"""Per-request xmix controls in the flat form that vLLM's ``vllm_xargs`` allows.

vLLM 0.32 types ``vllm_xargs`` as ``dict[str, str | int | float | list[str | int | float]]``:
no nested objects, so the canonical control ``{"apps": [...], "params": {app: {name: v}}}``
can only travel there as a JSON string under ``"xmix"``. The flat form spells the same thing
with one key per item:

    "xmix_apps": ["steer", "probe"]      or  "xmix_apps": "steer,probe"
    "xmix.steer.scale": 2.0                  one parameter: xmix.<app>.<name>
    "xmix.steer.push.scale": 2.0             <name> as in the JSON form (may hold a dot)

    "xmix_encoding": "base64"            result options (docs/serving.md, Results):
    "xmix_compression": "zstd"           xmix_<option> = the JSON form's "<option>";
    "xmix_dtype": "bfloat16"             "xmix_positions" also takes the text form
    "xmix_positions": "-1:"              "prompt", "-8:", "0:4,generated" (or a list of
    "xmix_max_result_bytes": 65536       such strings), as vllm_xargs has no null

App names are letters, digits and '_' (``xmix.lang.api``), so the first dot after ``xmix.`` ends
the app name. The same keys work in offline ``SamplingParams.extra_args``. A request carries
either the JSON form or the flat form: both at once is refused, naming the keys of each.
Every other key that starts with ``xmix_`` or ``xmix.`` is refused too (a misspelt control
must not be silently ignored), and so is "xmix" spelt in another case or with "-"
("XMIX_APPS", "Xmix_apps", "xmix-apps"), naming the right spelling; keys that do not start
with "xmix" are other extensions' business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

CONTROL_KEY = "xmix"
APPS_KEY = "xmix_apps"
PARAM_PREFIX = "xmix."
FLAT_PREFIXES = ("xmix_", PARAM_PREFIX)
OPTION_PREFIX = "xmix_"
OPTION_NAMES = ("encoding", "compression", "dtype", "positions", "max_result_bytes")


def is_flat_key(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(FLAT_PREFIXES)


def looks_like_xmix(key: Any) -> bool:
    """A key meant for xmix whatever its spelling: "xmix" in any case, alone or followed by
    "_", "." or "-" ("XMIX_APPS", "Xmix_apps", "xmix-apps", "XMIX.steer.scale")."""
    return (
        isinstance(key, str)
        and key[:4].lower() == CONTROL_KEY
        and (len(key) == 4 or key[4] in "_.-")
    )


def _known_flat() -> tuple[str, ...]:
    return (APPS_KEY, *(OPTION_PREFIX + o for o in OPTION_NAMES))


def misspelt(key: Any) -> bool:
    """An xmix-looking key not spelt as xmix's keys start (lower-case "xmix_" / "xmix.");
    those that are, but name nothing xmix knows, are refused where the flat form is read."""
    return looks_like_xmix(key) and key != CONTROL_KEY and not is_flat_key(key)


def right_spelling(key: str) -> str | None:
    """The key xmix knows that a misspelt xmix-looking key stands for, or None."""
    if len(key) == 4:
        return CONTROL_KEY
    if key[4] == ".":
        return PARAM_PREFIX + key[5:]  # app and parameter names are case-sensitive: kept
    flat = OPTION_PREFIX + key[5:].lower().replace("-", "_")
    return flat if flat in _known_flat() else None


def has_control(extra_args: Mapping | None) -> bool:
    """Whether a request's extra args carry an xmix control in either form (a misspelt one
    too: it is refused, with the right spelling)."""
    if not extra_args:
        return False
    return any(k == CONTROL_KEY or is_flat_key(k) or looks_like_xmix(k) for k in extra_args)


def _short(v: Any, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _apps(value: Any, fail: Callable[[str], Exception]) -> list[str]:
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",")] if value.strip() else []
    elif isinstance(value, (list, tuple)):
        if not all(isinstance(n, str) for n in value):
            raise fail(f'"{APPS_KEY}" must list app names as strings, got {_short(value)}')
        names = [n.strip() for n in value]
    else:
        raise fail(
            f'"{APPS_KEY}" must be a list of app names or a comma-separated string, '
            f"got {type(value).__name__}"
        )
    if any(not n for n in names):
        raise fail(f'"{APPS_KEY}" has an empty app name: {_short(value)}')
    return names


def control_from_args(
    extra_args: Mapping | None, error: Callable[[str], Exception] = ValueError
) -> Any:
    """The request's xmix control: the JSON form's value as given (a string or a dict, checked
    later by admission), the canonical dict built from the flat form, or None when the request
    has neither. ``error(message)`` makes the exception raised for a malformed flat form."""
    if not extra_args:
        return None
    for k in extra_args:
        if misspelt(k):
            right = right_spelling(k)
            raise error(
                f"unknown xmix key {_short(k)} in vllm_xargs; "
                + (
                    f"did you mean {right!r}?"
                    if right is not None
                    else f"xmix's keys are {CONTROL_KEY!r} (the JSON form), {APPS_KEY!r}, "
                    f"'{PARAM_PREFIX}<app>.<parameter>' and "
                    f"{', '.join(repr(OPTION_PREFIX + o) for o in OPTION_NAMES)}, in lower case"
                )
            )
    flat = sorted(k for k in extra_args if is_flat_key(k))
    if CONTROL_KEY in extra_args:
        if flat:
            raise error(
                f'the request has both the JSON form "{CONTROL_KEY}" and the flat form '
                f"{', '.join(repr(k) for k in flat[:8])}{' ...' if len(flat) > 8 else ''}; "
                "use one of them"
            )
        return extra_args[CONTROL_KEY]
    if not flat:
        return None
    apps: list[str] = []
    params: dict[str, dict[str, Any]] = {}
    options: dict[str, Any] = {}
    for key in flat:
        value = extra_args[key]
        if key == APPS_KEY:
            apps = _apps(value, error)
            continue
        option = key[len(OPTION_PREFIX) :] if key.startswith(OPTION_PREFIX) else None
        if option in OPTION_NAMES:
            if option == "positions":
                from xmix.lang.results_codec import positions_from_text

                try:
                    value = positions_from_text(value)
                except ValueError as e:
                    raise error(f"{key!r}: {e}") from None
            options[option] = value  # checked by admission with the JSON form's options
            continue
        if not key.startswith(PARAM_PREFIX):
            right = right_spelling(key)
            raise error(
                f"unknown flat control {key!r}; "
                + (f"did you mean {right!r}? " if right is not None and right != key else "")
                + f"the flat form has {APPS_KEY!r}, "
                f"'{PARAM_PREFIX}<app>.<parameter>' and "
                f"{', '.join(repr(OPTION_PREFIX + o) for o in OPTION_NAMES)} keys"
            )
        app, _, name = key[len(PARAM_PREFIX) :].partition(".")
        if not app or not name:
            raise error(f"flat control {key!r} must be '{PARAM_PREFIX}<app>.<parameter>'")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{key!r} must be a number, got {_short(value)}")
        params.setdefault(app, {})[name] = value
    return {"apps": apps, "params": params, **options}
