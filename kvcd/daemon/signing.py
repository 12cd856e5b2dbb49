"""The executor's side of module signatures: sign what was extracted (kvcd.toml's sign_key and
sign_cert), and refuse a module before the load when this kernel would refuse it."""

from __future__ import annotations

import logging
from pathlib import Path

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.host import modsign
from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)


def sign_extracted(settings: Settings, found: list[Path], fields: dict[str, str]) -> None:
    """Sign each extracted module file in place, before the manifest records its digest."""
    if not settings.sign_key:
        return
    key, cert = Path(settings.sign_key), Path(settings.sign_cert)
    for path in found:
        try:
            modsign.sign(path, key, cert, settings.sign_hash)
        except (modsign.SignError, OSError) as exc:
            raise StepFailed(state.SIGN_FAILED, str(exc)) from exc
    log.info("signed %d modules with %s", len(found), cert, extra=fields)


def unsigned_by_library(cfg: InstanceConfig, settings: Settings) -> str | None:
    """Why kvcd.toml's sign_key does not reach a KVC library instance (None when it does, or
    none is set): its `<name>-lib.sh` builds and loads the modules, kvcd extracts nothing."""
    if not settings.sign_key or cfg.kvc_lib is None:
        return None
    return (
        f"sign_key (kvcd.toml) does not reach this instance: its library {cfg.kvc_lib} builds "
        "and loads the modules itself, so kvcd neither signs them nor checks their signatures "
        "before the load"
    )


def signer_fields(path: Path) -> dict[str, str | None]:
    """The manifest's signer, sig_key and sig_hash of a module file: signer "" when it is
    unsigned (None in a manifest of an older kvcd: not recorded)."""
    sig = modsign.signature(path)
    if sig is None:
        return {"signer": "", "sig_key": None, "sig_hash": None}
    return {"signer": sig.signer, "sig_key": sig.key, "sig_hash": sig.hash}


class LoadCheck:
    """Asked before each load; reads the kernel's enforcement once per plan."""

    def __init__(self, root: HostRoot, settings: Settings | None) -> None:
        self.root = root
        self.cert = settings.sign_cert if settings else ""
        self._rules: modsign.Enforcement | None = None

    def check(self, name: str, path: str | None) -> None:
        if self._rules is None:
            self._rules = modsign.enforcement(self.root)
        if path is None or not self._rules.enforced:
            return
        refused = modsign.refusal(self.root, self._rules, Path(path), self.cert)
        if refused is not None:
            code, why = refused
            raise StepFailed(code, f"{name}: {why}")
