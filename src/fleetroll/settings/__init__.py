"""Settings: one object, built once at the entry point and passed down.

Sources, later ones winning, tables deep-merged:

1. the shipped defaults, ``config/fleetroll.toml``;
2. an optional user TOML file (``--config``);
3. ``FLEETROLL_*`` environment variables, nested with ``__``
   (``FLEETROLL_TIMEOUTS__CALL_TOOL_S=30``); ``FLEET_API_KEY``,
   ``FLEET_BASE_URL`` and ``LOGFIRE_TOKEN`` keep their usual names. A
   ``FLEETROLL_*`` variable that names no setting is ignored, with one
   warning per name (logger ``fleetroll.settings``) suggesting the closest
   setting;
4. explicit keyword arguments to :func:`load_settings`.

No module reads the environment on import: only :func:`load_settings` does.
"""

from __future__ import annotations

import contextvars
import difflib
import json
import logging
import os
import re
import tomllib
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import AliasChoices, BaseModel, Field, SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from fleetroll.errors import ConfigError
from fleetroll.settings.sections import (
    SERVICE_FOLDER,
    STORE_FILE,
    AdmissionSettings,
    BreakerSettings,
    EmulatorSettings,
    EnvAdmissionSettings,
    JudgeSettings,
    McpSettings,
    ModalitySettings,
    PolicySettings,
    PoolSettings,
    ProvisioningSettings,
    RetrySettings,
    SamplingSettings,
    ServiceSettings,
    TelemetrySettings,
    TimeoutSettings,
    TraceSettings,
)

__all__ = [
    "AdmissionSettings",
    "BreakerSettings",
    "EmulatorSettings",
    "EnvAdmissionSettings",
    "JudgeSettings",
    "McpSettings",
    "ModalitySettings",
    "PolicySettings",
    "PoolSettings",
    "ProvisioningSettings",
    "RetrySettings",
    "SamplingSettings",
    "ServiceSettings",
    "Settings",
    "TelemetrySettings",
    "TimeoutSettings",
    "TraceSettings",
    "config_dir",
    "load_settings",
]


def config_dir() -> Path:
    """The folder holding the shipped ``fleetroll.toml`` and example tasks."""
    here = Path(__file__).resolve().parent.parent  # the fleetroll package
    packaged = here / "_config"  # wheel installs: force-included by the build
    if packaged.is_dir():
        return packaged
    return here.parent.parent / "config"  # source checkout / editable install


_log = logging.getLogger("fleetroll.settings")

_ENV_PREFIX = "FLEETROLL_"
_NESTED = "__"
#: Unknown variable names already warned about (once per name per process).
_warned: set[str] = set()


def _unwrap(annotation: Any) -> Any:
    """``X`` from ``X | None`` and ``Annotated[X, ...]``."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            options = [a for a in get_args(annotation) if a is not type(None)]
            if len(options) != 1:
                return annotation
            annotation = options[0]
        else:
            return annotation


def _settable(model: type[BaseModel]) -> dict[str, Any]:
    """A model's fields that ``FLEETROLL_<PATH>`` reaches (aliased ones have their own names)."""
    return {
        name: info.annotation
        for name, info in model.model_fields.items()
        if info.validation_alias is None
    }


def _corrected(annotation: Any, parts: list[str]) -> list[str] | None:
    """``parts`` (a lower-case variable name split at ``__``) as they should be spelled.

    Equal to ``parts`` when they name a setting (or a key of a dict setting);
    a guess with the closest field name at each level otherwise; None when
    there is no guess.
    """
    annotation = _unwrap(annotation)
    if not parts:
        return []
    if annotation is Any:
        return parts
    if get_origin(annotation) in (dict, Mapping):
        args = get_args(annotation)
        rest = _corrected(args[1] if len(args) == 2 else Any, parts[1:])
        return None if rest is None else [parts[0], *rest]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        fields = _settable(annotation)
        head = parts[0]
        if head not in fields:
            close = difflib.get_close_matches(head, list(fields), n=1, cutoff=0.6)
            if not close:
                return None
            head = close[0]
        rest = _corrected(fields[head], parts[1:])
        return None if rest is None else [head, *rest]
    return None  # a plain value has nothing below it


def _flat_names(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every ``section__field`` a variable can name (dict settings: their own name)."""
    for name, annotation in _settable(model).items():
        inner = _unwrap(annotation)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            yield from _flat_names(inner, f"{prefix}{name}{_NESTED}")
        else:
            yield f"{prefix}{name}"


def _alias_names(model: type[BaseModel]) -> set[str]:
    names: set[str] = set()
    for info in model.model_fields.values():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(str(choice).lower() for choice in alias.choices)
        elif isinstance(alias, str):
            names.add(alias.lower())
    return names


def _unknown_variable(name: str, model: type[BaseModel]) -> str | None:
    """Why the lower-case variable ``name`` is ignored (with a guess), or None if it is known."""
    if name in _alias_names(model):
        return None
    prefix = _ENV_PREFIX.lower()
    rest = name[len(prefix) :]
    parts = rest.split(_NESTED)
    guess = _corrected(model, parts)
    if guess == parts:
        return None
    aliases = [a[len(_ENV_PREFIX) :] for a in _alias_names(model) if a.startswith(prefix)]
    candidates = [*_flat_names(model), *aliases]
    if guess is not None:
        candidates.append(_NESTED.join(guess))
    close = difflib.get_close_matches(rest, candidates, n=1, cutoff=0.6)
    suggestion = close[0] if close else None
    hint = f"; did you mean {(_ENV_PREFIX + suggestion).upper()}?" if suggestion else ""
    return f"is not a fleetroll setting and is ignored{hint}"


class _EnvironmentSource(EnvSettingsSource):
    """``EnvSettingsSource`` that drops, and warns about, ``FLEETROLL_*`` names of no setting."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        loaded = super()._load_env_vars()
        spelled = {name.lower(): name for name in os.environ}
        kept: dict[str, str | None] = {}
        prefix = _ENV_PREFIX.lower()
        for name, value in loaded.items():
            problem = (
                _unknown_variable(name, self.settings_cls) if name.startswith(prefix) else None
            )
            if problem is None:
                kept[name] = value
                continue
            shown = spelled.get(name, name.upper())
            if shown not in _warned:
                _warned.add(shown)
                _log.warning("%s %s", shown, problem)
        return kept


_user_config: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "fleetroll_user_config", default=None
)


class Settings(BaseSettings):
    """All of fleetroll's configuration. Build it with :func:`load_settings`."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETROLL_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        populate_by_name=True,
    )

    fleet_api_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices("FLEET_API_KEY", "fleet_api_key")
    )
    fleet_base_url: str | None = Field(
        None, validation_alias=AliasChoices("FLEET_BASE_URL", "fleet_base_url")
    )
    logfire_token: SecretStr | None = Field(
        None, validation_alias=AliasChoices("LOGFIRE_TOKEN", "logfire_token")
    )
    #: API key of the OpenAI-compatible policy endpoint, if it needs one.
    openai_api_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices("OPENAI_API_KEY", "openai_api_key")
    )
    #: Bearer token of ``fleetroll serve``; required to bind anything but loopback.
    service_token: SecretStr | None = Field(
        None, validation_alias=AliasChoices("FLEETROLL_SERVICE_TOKEN", "service_token")
    )
    #: The key the emulator accepts (``fleetroll emulator``); generated at start when unset.
    emulator_api_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices("FLEETROLL_EMULATOR_API_KEY", "emulator_api_key")
    )
    #: API key of the judge endpoint (``judge.base_url``) of tasks' ``rewards``;
    #: never the policy's ``OPENAI_API_KEY``.
    judge_api_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices("FLEETROLL_JUDGE_API_KEY", "judge_api_key")
    )

    timeouts: TimeoutSettings = TimeoutSettings()
    provisioning: ProvisioningSettings = ProvisioningSettings()
    admission: AdmissionSettings = AdmissionSettings()
    retries: RetrySettings = RetrySettings()
    modalities: dict[str, ModalitySettings] = Field(default_factory=dict)
    pool: PoolSettings = PoolSettings()
    policy: PolicySettings = PolicySettings()
    sampling: SamplingSettings = SamplingSettings()
    telemetry: TelemetrySettings = TelemetrySettings()
    emulator: EmulatorSettings = EmulatorSettings()
    service: ServiceSettings = ServiceSettings()
    mcp: McpSettings = McpSettings()
    traces: TraceSettings = TraceSettings()
    judge: JudgeSettings = JudgeSettings()

    @property
    def uses_emulator(self) -> bool:
        """True when no Fleet is configured, so the embedded emulator is the backend."""
        return self.fleet_api_key is None and self.fleet_base_url is None

    def secrets(self) -> tuple[str, ...]:
        """The value of every secret setting (each ``SecretStr`` field, in any section).

        The one list every redactor is built from (telemetry events, results,
        the service's errors): a secret field added to the settings is redacted
        everywhere without naming it again.
        """
        return tuple(_secret_values(self))

    def with_state_dir(self, root: Path) -> Settings:
        """These settings with what ``fleetroll serve`` keeps under ``root``
        (``--state-dir``), laid out as under ``.fleetroll/`` by default: the
        telemetry store ``root/telemetry.db`` (``telemetry.db_path``) and the
        service's folder ``root/service`` (``service.state_dir``: the batches'
        journals, the agents' records, the run id)."""
        return self.model_copy(
            update={
                "telemetry": self.telemetry.model_copy(update={"db_path": root / STORE_FILE}),
                "service": self.service.model_copy(update={"state_dir": root / SERVICE_FOLDER}),
            }
        )

    def require_fleet_api_key(self) -> str:
        """The key for a configured Fleet (not the embedded emulator).

        Raises:
            ConfigError: FLEET_BASE_URL is set without FLEET_API_KEY (every create
                would answer 401): said once, before anything runs.
        """
        if self.fleet_api_key is None:
            raise ConfigError(
                "FLEET_BASE_URL is set but FLEET_API_KEY is not; set it to the platform's key"
                " (`fleetroll emulator` prints the export line for its own)"
            )
        return self.fleet_api_key.get_secret_value()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        files = [config_dir() / "fleetroll.toml"]
        user = _user_config.get()
        if user is not None:
            files.append(user)
        toml = TomlConfigSettingsSource(settings_cls, toml_file=files, deep_merge=True)
        return init_settings, _EnvironmentSource(settings_cls), toml


def _secret_values(value: object) -> Iterator[str]:
    if isinstance(value, SecretStr):
        yield value.get_secret_value()
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _secret_values(getattr(value, name))
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _secret_values(item)


def load_settings(config_file: str | Path | None = None, /, **overrides: Any) -> Settings:
    """Build the settings from every source (see the module docstring).

    Args:
        config_file: an optional user TOML file, merged over the shipped defaults.
        **overrides: explicit values, winning over every other source.

    Raises:
        ConfigError: a file is missing or unreadable, or a value is invalid; the
            message names the field and the reason.
    """
    path: Path | None = None
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: not a valid TOML file: {exc}") from exc
        unknown = _unknown_key(data, Settings)
        if unknown is not None:
            raise ConfigError(f"{path}: {unknown}")
    token = _user_config.set(path)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        source = f" (with {path})" if path else ""
        raise ConfigError(f"invalid configuration{source}:\n{_describe(exc)}") from None
    except SettingsError as exc:  # a variable holding a table (JSON) that does not parse
        raise ConfigError(_describe_environment_error(exc)) from None
    finally:
        _user_config.reset(token)


def _describe_environment_error(exc: SettingsError) -> str:
    """Which ``FLEETROLL_*`` variable is not valid JSON, and the JSON error."""
    found = re.search(r'field "([^"]+)"', str(exc))
    field = found.group(1) if found else None
    cause = exc.__cause__ or exc.__context__
    if field is not None:
        stem = f"{_ENV_PREFIX}{field}".lower()
        for name, value in sorted(os.environ.items()):
            lowered = name.lower()
            if lowered != stem and not lowered.startswith(stem + _NESTED):
                continue
            try:
                json.loads(value)
            except ValueError as error:
                if value.lstrip().startswith(("{", "[")):
                    return f"{name} is not valid JSON: {error}"
        return f"{_ENV_PREFIX}{field.upper()}: cannot be read: {cause or exc}"
    return f"the environment cannot be read: {cause or exc}"


def _unknown_key(
    data: Mapping[str, Any], model: type[BaseModel], path: tuple[str, ...] = ()
) -> str | None:
    """The first key of ``data`` that names no setting of ``model``, said with the
    closest setting at its level (``unknown key 'pool.concurency' (did you mean
    'pool.concurrency'?)``), or None when every key is known."""
    fields = model.model_fields
    known = set(fields) | (_alias_names(model) if not path else set())
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=0.6)
            guess = f" (did you mean {'.'.join((*path, close[0]))!r}?)" if close else ""
            return f"unknown key {'.'.join((*path, key))!r}{guess}"
        if key not in fields or not isinstance(value, Mapping):
            continue  # an alias, or a value: pydantic checks it
        inner = _unwrap(fields[key].annotation)
        # A table of tables (``[modalities.NAME]``): each row is checked as a section.
        row = _unwrap(get_args(inner)[-1]) if get_origin(inner) in (dict, Mapping) else None
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            tables = {(*path, key): value}
            section: type[BaseModel] = inner
        elif isinstance(row, type) and issubclass(row, BaseModel):
            tables = {(*path, key, n): t for n, t in value.items() if isinstance(t, Mapping)}
            section = row
        else:
            continue
        for where, table in tables.items():
            found = _unknown_key(table, section, where)
            if found is not None:
                return found
    return None


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(part) for part in error["loc"]) or "(root)"
        lines.append(f"  {where}: {error['msg']}")
    return "\n".join(lines)
