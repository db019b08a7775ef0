"""vLLM general-plugin entry point: wires the guard in from the environment alone.

vLLM calls :func:`register` once in every process it starts (front end, engine
core, workers). Only the front end builds the engine configuration, so the one
thing done here is to wrap ``EngineArgs.create_engine_config`` (connector/patches.py): when it runs
with ``VLLM_KVGUARD=1`` it adds the guard's KV connector to the configuration
(composing with a connector the user set, through vLLM's MultiConnector), and
with a bad ``VLLM_KVGUARD*`` value it stops start-up with the error. With the
guard off the wrapper calls the original and changes nothing.

The environment is read when the engine is configured, not when the plugin
loads, so a process that builds several engines sees the current settings.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm_kvguard.config import BESIDE_KEY, KVGuardConfig, Mode, load_config
from vllm_kvguard.errors import KVGuardConfigError

CONNECTOR = "KVGuardConnector"
# The same guard declaring vLLM's SupportsHMA, for engines that run the hybrid KV
# cache manager (explicitly asked for, or needed by a hybrid SSM model).
HMA_CONNECTOR = "KVGuardHMAConnector"
MODULE = "vllm_kvguard.connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_kvguard.connector import patches

    # By name too: vLLM looks connectors up by class name on its stats path under a
    # MultiConnector, where the module path is not consulted.
    for name in (CONNECTOR, HMA_CONNECTOR):
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, MODULE, name)

    patches.quiet_unknown_variable_warnings()
    patches.patch_openai_errors()
    patches.patch_stop_string_flags()
    patches.guard_kernel_scan()
    patches.keep_cores_for_the_forward(guard_alone)
    _install_config_error_hook()
    if not patches.patch_engine_config(_add_guard) and load_config().enabled:
        raise RuntimeError(
            "vllm-kvguard: this vLLM has no EngineArgs.create_engine_config, so VLLM_KVGUARD=1 cannot "
            "add the guard to the engine; see the supported versions in the README"
        )


def guard_alone(vllm_config: Any) -> bool:
    """Whether the guard is the engine's only KV connector (not beside a transfer connector)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    return ktc is not None and getattr(ktc, "kv_connector", None) in (CONNECTOR, HMA_CONNECTOR)


def _install_config_error_hook() -> None:
    """A bad ``VLLM_KVGUARD*`` value that nobody catches (``vllm serve``, a script calling
    ``LLM(...)``) ends the process with one line, not vLLM's start-up traceback. Code that
    catches :class:`KVGuardConfigError` still gets the exception; any other exception goes to
    the hook that was there before."""
    previous = sys.excepthook
    if getattr(previous, "_kvguard", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if isinstance(exc, KVGuardConfigError):
            print(f"vllm-kvguard: {exc} (see `kvguard config` and docs/configuration.md)", file=sys.stderr)
            return
        previous(kind, exc, tb)

    hook._kvguard = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _add_guard(engine_args: Any) -> None:
    """Add the guard's connector to an engine being configured, when ``VLLM_KVGUARD=1``
    (a bad ``VLLM_KVGUARD*`` value raises here and stops start-up)."""
    config = load_config()
    if config.enabled:
        hma = _needs_hybrid_manager(engine_args)
        engine_args.kv_transfer_config = compose_kv_transfer_config(
            engine_args.kv_transfer_config, config, hma=hma
        )
        if not hma and getattr(engine_args, "disable_hybrid_kv_cache_manager", False) is None:
            # What vLLM would decide for a connector without SupportsHMA, said explicitly so that
            # it does not warn about a `--kv-transfer-config` the operator never gave.
            engine_args.disable_hybrid_kv_cache_manager = True


def _needs_hybrid_manager(engine_args: Any) -> bool:
    """Whether vLLM must keep its hybrid KV cache manager for this engine.

    A connector without ``SupportsHMA`` makes vLLM turn the manager off. For most
    models that is what the guard wants: one KV cache group, every page guarded
    (sliding-window layers then keep full-length KV, which vLLM warns costs memory).
    But an operator who asked for the manager explicitly gets a start-up error
    from vLLM, and hybrid SSM models (Jamba, Bamba, ...) cannot start without it:
    there the guard takes the ``SupportsHMA`` form and stands aside when the
    engine has several KV cache groups (``kvguard_inactive`` at start-up).
    """
    if getattr(engine_args, "disable_hybrid_kv_cache_manager", None) is False:
        return True
    try:
        return bool(engine_args.create_model_config().is_hybrid)
    except Exception:
        # The engine's own configuration step reports whatever is wrong with the model.
        return False


def _as_dict(ktc: Any) -> dict[str, Any]:
    if ktc is None:
        return {}
    if isinstance(ktc, dict):
        return dict(ktc)
    from dataclasses import fields

    return {f.name: getattr(ktc, f.name) for f in fields(ktc) if getattr(ktc, f.name) is not None}


def _failure_policy(config: KVGuardConfig, user_policy: str | None) -> Any:
    # raise: vLLM fails the readers of a bad block; quarantine: it recomputes them.
    if config.mode == Mode.RAISE:
        return "fail"
    if config.mode == Mode.QUARANTINE:
        return "recompute"
    return user_policy or "recompute"


def compose_kv_transfer_config(ktc: Any, config: KVGuardConfig, *, hma: bool = False) -> Any:
    """The user's KV transfer config with the guard added (idempotent)."""
    from vllm.config import KVTransferConfig

    ours: dict[str, Any] = {
        "kv_connector": HMA_CONNECTOR if hma else CONNECTOR,
        "kv_connector_module_path": MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvguard": config.to_dict()},
    }
    user = _as_dict(ktc)
    user_connector = user.get("kv_connector")
    policy = _failure_policy(config, user.get("kv_load_failure_policy") if user else None)
    if not user_connector or user_connector in (CONNECTOR, HMA_CONNECTOR):
        return KVTransferConfig(**ours, kv_load_failure_policy=policy)
    # Beside another connector the guard is a MultiConnector child, built by vLLM from its own
    # entry with the field defaults ("fail"): the policy vLLM applies is the top level's, so the
    # guard's entry carries it too, and kvguard_started states the policy the scheduler uses.
    ours["kv_load_failure_policy"] = policy
    if user_connector == "MultiConnector":
        extra = dict(user.get("kv_connector_extra_config") or {})
        children = [
            c for c in extra.get("connectors", []) if c.get("kv_connector") not in (CONNECTOR, HMA_CONNECTOR)
        ]
        ours["kv_connector_extra_config"][BESIDE_KEY] = [str(c.get("kv_connector")) for c in children]
        extra["connectors"] = [*children, ours]
        user["kv_connector_extra_config"] = extra
        user["kv_load_failure_policy"] = policy
        return KVTransferConfig(**user)
    ours["kv_connector_extra_config"][BESIDE_KEY] = [str(user_connector)]
    child = {k: v for k, v in user.items() if k not in ("kv_load_failure_policy", "engine_id")}
    top = {k: user[k] for k in ("kv_role", "engine_id", "kv_buffer_device") if k in user}
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_connector_extra_config={"connectors": [child, ours]},
        kv_load_failure_policy=policy,
        **top,
    )
