"""Image variants: pick the one that fits this node (GEP-33) and explain the choice.

`resolve_variant` is called where an Instance is made (kvcd/daemon/instance.py), so everything
downstream (desired_for, the executor's build) sees a config whose `image`/`build` are the
picked variant's and whose `variant` names it. Node capabilities are discovered only for
instances that have variants. No fit is not an exception here: the instance keeps its config,
`Instance.plan` refuses build/load with NoVariant, and the `VariantGate` extension holds the
daemon's reconcile as Degraded with the per-variant explanation.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import state
from kvcd.core.capabilities import Decision, decide
from kvcd.daemon.events import HOLD, Context, Event, Extension, Verdict
from kvcd.host import discover
from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)


def node_capabilities(
    root: HostRoot, settings: Settings, kernel: str | None = None
) -> dict[str, tuple[str, ...]]:
    return discover.discover(root, settings.node_capabilities, kernel)


def decision(cfg: InstanceConfig, node: dict[str, tuple[str, ...]]) -> Decision:
    variants = [(v.name, dict(v.capabilities)) for v in cfg.variants]
    return decide(node, variants, dict(cfg.capabilities))


def resolve_variant(
    root: HostRoot, settings: Settings, cfg: InstanceConfig, kernel: str | None = None
) -> tuple[InstanceConfig, str | None]:
    """(config with the picked variant applied, None) or (config unchanged, why nothing fits).

    `kernel`: the kernel the instance is for (default: the running one); its release decides
    kernel_release/kernel_version/kernel_flavor. A config without variants, or one already
    resolved, comes back as it is."""
    if not cfg.variants or cfg.variant is not None:
        return cfg, None
    d = decision(cfg, node_capabilities(root, settings, kernel))
    if d.picked is None:
        return cfg, d.no_fit_message()
    picked = next(v for v in cfg.variants if v.name == d.picked)
    log.debug("%s: variant %s (%s)", cfg.name, picked.name, "; ".join(d.explain()))
    return dataclasses.replace(
        cfg, variant=picked.name, image=picked.image, build=picked.build
    ), None


class VariantGate(Extension):
    """Holds the reconcile as Degraded (NoVariant, with the explanation) when nothing fits."""

    name = "variants"

    def __init__(self, root: HostRoot | None = None) -> None:
        self.root = root

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        if not ctx.cfg.variants or ctx.cfg.variant is not None:
            return None
        _, why = resolve_variant(self.root or ctx.root, ctx.settings, ctx.cfg, ctx.kernel)
        if why is None:  # the node changed since the Instance was made; the next one fits
            return None
        return Verdict(HOLD, state.DEGRADED, state.NO_VARIANT, why)


# --- `kvcd capabilities [--json] [--explain NAME]` -------------------------------------------


def _short(values: tuple[str, ...], limit: int = 12) -> str:
    if len(values) <= limit:
        return " ".join(values) or "(none)"
    return " ".join(values[:limit]) + f" … ({len(values)} in all)"


def capabilities_command(
    root: HostRoot, as_json: bool, explain: str | None, kernel: str | None = None
) -> int:
    """Print the node's capabilities, or how an instance's variant is chosen. Exit 0, or 1
    when --explain finds that no variant fits."""
    import json

    from kvcd.config.loader import load_instance, load_settings

    settings = load_settings(root)
    node = node_capabilities(root, settings, kernel)
    pinned = sorted(name for name, _ in settings.node_capabilities)
    if explain is None:
        if as_json:
            caps = {k: list(v) for k, v in node.items()}
            print(json.dumps({"capabilities": caps, "pinned": pinned}, indent=2, sort_keys=True))
        else:
            for name, values in node.items():
                pin = "  (pinned)" if name in pinned else ""
                print(f"{name}: {_short(values)}{pin}")
        return 0
    cfg = load_instance(root, explain)
    if not cfg.variants:
        msg = f"{cfg.name}: no [variants]; it uses its own image/build on every node"
        if as_json:
            print(json.dumps({"instance": cfg.name, "variants": [], "picked": None}, indent=2))
        else:
            print(msg)
        return 0
    d = decision(cfg, node)
    table = dict(cfg.capabilities)
    names = list(table) + sorted(
        {n for v in cfg.variants for n, _ in v.capabilities if n not in table}
    )
    if as_json:
        doc: dict[str, Any] = {
            "instance": cfg.name,
            "node": {n: list(node.get(n, ())) for n in names},
            "preference": {k: list(v) for k, v in table.items()},
            "picked": d.picked,
            "candidates": [
                {
                    "variant": c.name,
                    "fits": c.excluded is None,
                    "excluded": None
                    if c.excluded is None
                    else {
                        "capability": c.excluded.capability,
                        "wanted": list(c.excluded.wanted),
                        "node": list(c.excluded.node),
                    },
                    "rank": list(c.rank),
                    "chosen": dict(c.chosen),
                }
                for c in d.candidates
            ],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(f"{cfg.name}: node capabilities that matter:")
        for n in names:
            order = f"  (preference: {', '.join(table[n])})" if n in table else ""
            print(f"  {n}: {_short(node.get(n, ()))}{order}")
        print("variants, in config order:")
        for line in d.explain():
            print(f"  {line}")
        print(f"picked: {d.picked}" if d.picked else d.no_fit_message())
    return 0 if d.picked else 1
