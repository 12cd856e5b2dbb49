"""KVC compatibility: /etc/kvc/<name>.conf read as data, never sourced; the lib.sh hook check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcd import cli
from kvcd.config.kvcconf import Assignment, parse_assignments
from kvcd.config.loader import (
    check_kvc_global,
    list_instances,
    load_instance,
    load_settings,
    parse_kvc_conf,
)
from kvcd.config.model import BuildSource, ConfigError, InstanceConfig, ModuleSpec
from kvcd.host.paths import HostRoot
from tests import fakehost
from tests.fakehost import doc, write

SRC = Path("/etc/kvc/simple-kmod.conf")
NOBODY = 65534


# The three required variables (lines 1-3), for rows that break something after them.
HEAD = (
    "KMOD_SOFTWARE_VERSION=dd1a7d4",
    'KMOD_NAMES="simple-kmod simple-procfs-kmod"',
    "KMOD_CONTAINER_BUILD_CONTEXT=https://github.com/kmods-via-containers/kvc-simple-kmod.git",
)


# --- good confs ----------------------------------------------------------------------------

KVC_SIMPLE = doc(
    "# comment",
    'KMOD_CONTAINER_BUILD_CONTEXT="https://github.com/kmods-via-containers/kvc-simple-kmod.git"',
    "KMOD_CONTAINER_BUILD_FILE=Dockerfile.fedora",
    "KMOD_SOFTWARE_VERSION=dd1a7d4",
    'KMOD_NAMES="simple-kmod simple-procfs-kmod"',
    "export FOO='bar baz'",
)


def test_kvc_simple_parses_to_exact_instance() -> None:
    assert parse_kvc_conf("simple-kmod", SRC, KVC_SIMPLE) == InstanceConfig(
        name="simple-kmod",
        source=SRC,
        version="dd1a7d4",
        modules=(ModuleSpec("simple-kmod"), ModuleSpec("simple-procfs-kmod")),
        build=BuildSource(
            context="https://github.com/kmods-via-containers/kvc-simple-kmod.git",
            containerfile="Dockerfile.fedora",
            args=(),
        ),
        image=None,
        modules_path="/lib/modules/{kernel}/",
        unload_policy="if-idle",
        keep_images=3,
        wrapper_args=(),
        kvc_lib=None,
        kvc_env=(("FOO", "bar baz"),),
        kvc_exported=("FOO",),
        format="kvc",
    )


def test_kvc_safe_subset_features() -> None:
    text = doc(
        "",
        "   # indented comment",
        "BASE=/usr/src/kmods  # trailing comment",
        'KMOD_CONTAINER_BUILD_CONTEXT="${BASE}/simple"',
        "KMOD_SOFTWARE_VERSION=1.2.3-4",
        "KMOD_NAMES=(simple-kmod 'simple-procfs-kmod')",
        'DQ="a \\"quoted\\" \\$HOME \\\\ \\`x\\` \\q $BASE"',
        "MIX=pre'lit $X'\"dq\"post",
        "HASH=a#b",
        "EMPTY=",
        "ESC=a\\ b",
        "NAME=$KVC_SOFTWARE_NAME-x",
        "LONE=$",
        "ML='line one",
        "line two'",
        "AFTER=ok",
        "export AFTER",
        "export AFTER BASE  # no-ops",
    )
    config = parse_kvc_conf("simple-kmod", SRC, text)
    assert config.version == "1.2.3-4"
    assert config.modules == (ModuleSpec("simple-kmod"), ModuleSpec("simple-procfs-kmod"))
    assert config.build == BuildSource("/usr/src/kmods/simple", "Dockerfile")  # KVC's default
    assert config.kvc_env == (
        ("BASE", "/usr/src/kmods"),
        ("DQ", 'a "quoted" $HOME \\ `x` \\q /usr/src/kmods'),
        ("MIX", "prelit $Xdqpost"),
        ("HASH", "a#b"),
        ("EMPTY", ""),
        ("ESC", "a b"),
        ("NAME", "simple-kmod-x"),
        ("LONE", "$"),
        ("ML", "line one\nline two"),
        ("AFTER", "ok"),
    )


def test_values_up_to_the_environment_bounds_are_accepted() -> None:
    """128000 bytes of NAME=VALUE, and a conf's variables up to 262144 bytes in all (counting
    each string's NUL; a reassigned variable counts once)."""
    big = 'NOTE="' + "\u20ac" * 42665 + '"'  # NOTE= and 127995 bytes
    config = parse_kvc_conf("simple-kmod", SRC, doc(*HEAD, big, big))
    assert len(("NOTE=" + dict(config.kvc_env)["NOTE"]).encode()) == 128000
    head = sum(len(h.replace('"', "").encode()) + 1 for h in HEAD)
    rest = 262144 - head - 2 * 128001
    parse_kvc_conf(
        "simple-kmod", SRC, doc(*HEAD, big, big.replace("NOTE", "NUTE"), "R=" + "x" * (rest - 3))
    )


def test_later_assignment_wins_and_expands_earlier_value() -> None:
    text = doc(*HEAD, "V=1", "V=${V}2", "KMOD_SOFTWARE_VERSION=v$V")
    config = parse_kvc_conf("x", SRC, text)
    assert config.version == "v12"
    assert config.kvc_env == (("V", "12"),)


def test_assignment_lines() -> None:
    text = doc("# c", "A=1", "", "export B='x", "y'", "C=(p q)", "export C D")
    assert parse_assignments(SRC, text) == [
        Assignment("A", "1", 2),
        Assignment("B", "x\ny", 4, exported=True),
        Assignment("C", "p q", 6, ("p", "q"), exported=True),
    ]


@pytest.mark.parametrize(
    ("lines", "exported"),
    [
        (("GIT_CONFIG_COUNT=1", "NOTE=x"), ()),  # KVC sourced the conf: shell variables only
        (("export NOTE=x",), ("NOTE",)),
        (("NOTE=x", "export NOTE"), ("NOTE",)),
        (("export NOTE", "NOTE=x"), ("NOTE",)),  # bash: the export stays on NOTE
        (("export KMOD_SOFTWARE_VERSION",), ("KMOD_SOFTWARE_VERSION",)),
        (("export UNSET",), ()),  # exports nothing the hooks get
    ],
)
def test_only_what_the_conf_exports_is_exported(
    lines: tuple[str, ...], exported: tuple[str, ...]
) -> None:
    assert parse_kvc_conf("x", SRC, doc(*HEAD, *lines)).kvc_exported == exported


# --- bad confs: (id, text, line, exact message fragment) -----------------------------------

BAD_KVC = [
    (
        "instance-runtime-not-podman",
        doc(*HEAD, "KVC_CONTAINER_RUNTIME=docker"),
        4,
        "KVC_CONTAINER_RUNTIME='docker': kvcd builds and runs driver containers with podman only",
    ),
    (
        "missing-version",
        doc(*HEAD[1:]),
        None,
        "missing required variable 'KMOD_SOFTWARE_VERSION'",
    ),
    (
        "missing-names",
        doc(HEAD[0], HEAD[2]),
        None,
        "missing required variable 'KMOD_NAMES'",
    ),
    (
        "missing-context",
        doc(*HEAD[:2]),
        None,
        "missing required variable 'KMOD_CONTAINER_BUILD_CONTEXT'",
    ),
    ("empty-names", doc(HEAD[0], 'KMOD_NAMES=""', HEAD[2]), 2, "'KMOD_NAMES' must not be empty"),
    (
        "duplicate-names",
        doc(HEAD[0], 'KMOD_NAMES="simple-kmod simple_kmod"', HEAD[2]),
        2,
        "duplicate module 'simple_kmod' in 'KMOD_NAMES' (same as 'simple-kmod'",
    ),
    (
        "bad-module-name",
        doc(HEAD[0], 'KMOD_NAMES="a/b"', HEAD[2]),
        2,
        "'KMOD_NAMES' entry \"a/b\" is not a module name",
    ),
    (
        "version-with-space",
        doc("KMOD_SOFTWARE_VERSION='1 0'", *HEAD[1:]),
        1,
        "'KMOD_SOFTWARE_VERSION' must match",
    ),
    (
        "relative-context",
        doc(*HEAD[:2], "KMOD_CONTAINER_BUILD_CONTEXT=kvc-simple-kmod"),
        3,
        "'KMOD_CONTAINER_BUILD_CONTEXT' must be an absolute path",
    ),
    (
        "ftp-context",
        doc(*HEAD[:2], "KMOD_CONTAINER_BUILD_CONTEXT=ftp://example.com/x.tar"),
        3,
        "'KMOD_CONTAINER_BUILD_CONTEXT': ftp:// is not a build context kvcd can use",
    ),
    (
        "build-file-dotdot",
        doc(*HEAD, "KMOD_CONTAINER_BUILD_FILE=../Dockerfile"),
        4,
        "'KMOD_CONTAINER_BUILD_FILE' must be a relative path inside the build context",
    ),
    (
        "array-not-names",
        doc(*HEAD, "OPTS=(a b)"),
        4,
        "'OPTS' is an array: only KMOD_NAMES may be one",
    ),
    (
        "version-array",
        doc("KMOD_SOFTWARE_VERSION=(1 2)", *HEAD[1:]),
        1,
        "'KMOD_SOFTWARE_VERSION' must be a string, not an array",
    ),
    (
        "unknown-variable",
        doc(*HEAD, "A=$UNDEFINED"),
        4,
        "unknown variable 'UNDEFINED': only variables assigned earlier in this file",
    ),
    (
        "variable-used-before-assignment",
        doc("A=$B", "B=1", *HEAD),
        1,
        "unknown variable 'B'",
    ),
    (
        "kvc-kver-runtime-only",
        doc(*HEAD, 'A="/lib/modules/${KVC_KVER}"'),
        4,
        "cannot expand '$KVC_KVER': it is the kernel version, known only at run time",
    ),
    (
        "kvc-software-name-assigned",
        doc(*HEAD, "KVC_SOFTWARE_NAME=other"),
        4,
        "'KVC_SOFTWARE_NAME' is set by kvcd from the instance name",
    ),
    (
        "default-expansion",
        doc(*HEAD, 'A="${X:-/tmp}"'),
        4,
        "parameter expansion '${X:-/tmp}' is not supported: only ${NAME}",
    ),
    ("length-expansion", doc(*HEAD, "A=${#HEAD}"), 4, "parameter expansion '${#HEAD}'"),
    (
        "expansion-bomb",  # 28 doublings would be 4 GiB: refused once a value passes the bound
        doc(*HEAD, "A=xxxxxxxxxxxxxxxx", *['A="$A$A"'] * 16),
        4 + 13,
        "expanding '$A' makes the value of 'A' longer than 65536 characters",
    ),
    (
        "expansion-bomb-one-line",
        doc(*HEAD, "A=" + "x" * 60000, "B=" + "$A" * 20),
        5,
        "expanding '$A' makes the value of 'B' longer than 65536 characters",
    ),
    (
        "expansion-copies",  # each value under the bound, all of them together over it
        doc(*HEAD, "A=" + "x" * 60000, *['B="$A"' for _ in range(30)]),
        4 + 18,
        "expanding '$A' makes the expanded values of this file longer than 1048576 characters",
    ),
    (
        "long-literal-value",
        doc(*HEAD, "A='" + "x" * 65537 + "'"),
        4,
        "the value of 'A' is 65537 characters long; a KVC conf value may have at most 65536",
    ),
    (
        # 60000 characters, 180000 bytes: over the kernel's 128 KiB for one environment string
        "multibyte-value",
        doc(*HEAD, 'NOTE="' + "\u20ac" * 60000 + '"'),
        4,
        "'NOTE=...' is 180005 bytes (UTF-8); a variable handed to a KVC library may have at "
        "most 128000",
    ),
    (
        "environment-total",  # each variable under the bounds, the conf's together over them
        doc(*HEAD, *[f'V{i}="' + "x" * 60000 + '"' for i in range(6)]),
        4 + 4,
        "with 'V4' the variables of this conf are 300181 bytes (UTF-8); a KVC library's "
        "environment from one conf may have at most 262144",
    ),
    ("positional", doc(*HEAD, "A=$1"), 4, "special parameter '$1' is not allowed"),
    ("ansi-c-quote", doc(*HEAD, "A=$'\\x41'"), 4, "'$'...' quoting is not allowed"),
    ("append", doc(*HEAD, "A+=x"), 4, "'A+=' (appending) is not supported"),
    ("glob-star", doc(*HEAD, "A=*.ko"), 4, "unquoted glob character '*' is not allowed"),
    ("glob-bracket", doc(*HEAD, "A=[ab]"), 4, "unquoted glob character '[' is not allowed"),
    ("tilde", doc(*HEAD, "A=~/src"), 4, "unquoted '~' (home directory expansion)"),
    ("brace", doc(*HEAD, "A={a,b}"), 4, "unquoted shell operator '{' is not allowed"),
    ("paren-in-word", doc(*HEAD, "A=a(b)"), 4, "unquoted '(' (a subshell or array)"),
    (
        "unterminated-double-quote",
        doc(*HEAD, 'A="never closed', "B=1", "C=2"),
        4,
        "unterminated double quote opened on line 4",
    ),
    (
        "unterminated-single-quote",
        doc(*HEAD, "X=1", "A='open", "B=2"),
        5,
        "unterminated single quote opened on line 5",
    ),
    ("unterminated-array", doc(*HEAD, "KMOD_NAMES=(a b"), 4, "unterminated array 'KMOD_NAMES=('"),
    (
        "continuation",
        doc(*HEAD, "A=one \\", "two"),
        4,
        "line continuation (backslash at the end of the line) is not supported",
    ),
    (
        "continuation-in-double-quotes",
        doc(*HEAD, 'A="one \\', 'two"'),
        4,
        "line continuation (backslash at the end of the line) is not supported",
    ),
    ("dos-line-endings", "A=1\r\n", 1, "carriage return found: the file has DOS line endings"),
    ("bare-word", doc(*HEAD, "echo hello"), 4, "not an assignment: 'echo hello'"),
    ("function", doc(*HEAD, "f() { :; }"), 4, "not an assignment: 'f() { :; }'"),
    ("export-alone", doc(*HEAD, "export"), 4, "not an assignment: 'export'"),
    ("export-then-command", doc(*HEAD, "export A; id"), 4, "not an assignment: 'export A; id'"),
    (
        "https-bad-ipv6",
        doc(*HEAD[:2], 'KMOD_CONTAINER_BUILD_CONTEXT="https://[::1/x"'),
        3,
        "'KMOD_CONTAINER_BUILD_CONTEXT' is not a valid https:// URL",
    ),
    (
        "ld-preload",
        doc(*HEAD, "LD_PRELOAD=/tmp/evil.so"),
        4,
        "'LD_PRELOAD' would change how the hooks run",
    ),
    ("path", doc(*HEAD, "PATH=/tmp"), 4, "'PATH' would change how the hooks run"),
    ("bash-env", doc(*HEAD, "BASH_ENV=/tmp/x"), 4, "'BASH_ENV' would change how the hooks run"),
    (
        "export-git-config",
        doc(*HEAD, "export GIT_CONFIG_COUNT=1"),
        4,
        "'export GIT_CONFIG_COUNT' would hand the programs the hooks run",
    ),
    (
        "export-later-git-ssh",
        doc(*HEAD, "GIT_SSH_COMMAND='sh -c id'", "export GIT_SSH_COMMAND"),
        4,
        "'export GIT_SSH_COMMAND' would hand the programs the hooks run",
    ),
    (
        "export-containers-conf",
        doc(*HEAD, "export CONTAINERS_CONF=/tmp/c.conf"),
        4,
        "'export CONTAINERS_CONF' would hand the programs the hooks run",
    ),
]

# Rows that carry a command: each must be refused, and the marker file must never appear.
INJECTION_KVC = [
    (
        "command-substitution",
        doc(*HEAD[::2], 'KMOD_NAMES="$(touch {marker})"'),
        3,
        "command substitution '$(...)' is not allowed",
    ),
    (
        "command-substitution-unquoted",
        doc(*HEAD, "A=$(touch {marker})"),
        4,
        "command substitution '$(...)' is not allowed",
    ),
    (
        "backticks-quoted",
        doc(*HEAD, 'KMOD_NAMES="`touch {marker}`"'),
        4,
        "command substitution with backticks is not allowed",
    ),
    (
        "backticks-unquoted",
        doc(*HEAD, "A=`touch {marker}`"),
        4,
        "command substitution with backticks is not allowed",
    ),
    (
        "ifs-expansion",
        doc(*HEAD, "A=touch${IFS}{marker}"),
        4,
        "unknown variable 'IFS'",
    ),
    (
        "semicolon-rm",
        doc(*HEAD, "KMOD_NAMES=x;rm -rf /;touch {marker}"),
        4,
        "unquoted shell operator ';' is not allowed",
    ),
    ("arithmetic", doc(*HEAD, "A=$((1+1))"), 4, "arithmetic expansion '$((...))' is not allowed"),
    (
        "prefix-assignment-runs-command",
        doc(*HEAD, "A=b touch {marker}"),
        4,
        "unexpected 'touch /",
    ),
    ("source", doc(*HEAD, "source {marker}.sh"), 4, "not an assignment: 'source /"),
    ("rm-rf", doc(*HEAD, "rm -rf / {marker}"), 4, "not an assignment: 'rm -rf / /"),
    ("pipe", doc(*HEAD, "A=x|touch {marker}"), 4, "unquoted shell operator '|' is not allowed"),
    ("and", doc(*HEAD, "A=x&&touch {marker}"), 4, "unquoted shell operator '&' is not allowed"),
    ("redirect", doc(*HEAD, "A=x>{marker}"), 4, "unquoted shell operator '>' is not allowed"),
    (
        "array-with-expansion",
        doc(*HEAD[::2], "C='touch {marker}'", "KMOD_NAMES=(a $C)"),
        4,
        "unquoted expansion inside an array is refused",
    ),
    (
        "array-with-substitution",
        doc(*HEAD[::2], "KMOD_NAMES=(a $(touch {marker}))"),
        3,
        "command substitution '$(...)' is not allowed",
    ),
    (
        "substitution-in-default",
        doc(*HEAD, 'A="${X:-$(touch {marker})}"'),
        4,
        "parameter expansion '${X:-$(touch {marker})}' is not supported",
    ),
    (
        "newline-hides-command",
        doc(*HEAD, "A='x", "'; touch {marker}"),
        5,
        "unquoted shell operator ';' is not allowed",
    ),
    ("heredoc", doc(*HEAD, "cat <<EOF > {marker}", "x", "EOF"), 4, "not an assignment: 'cat <<EOF"),
    ("eval", doc(*HEAD, "eval 'touch {marker}'"), 4, "not an assignment: \"eval 'touch /"),
]


def _expect(exc: ConfigError, path: Path, line: int | None, fragment: str) -> None:
    assert exc.path == path
    assert exc.line == line
    assert fragment in exc.detail
    where = f"{path}:{line}: " if line else f"{path}: "
    assert str(exc).startswith(where)


@pytest.mark.parametrize(
    ("text", "line", "fragment"), [pytest.param(t, ln, f, id=i) for i, t, ln, f in BAD_KVC]
)
def test_bad_kvc_conf(text: str, line: int | None, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_kvc_conf("simple-kmod", SRC, text)
    _expect(caught.value, SRC, line, fragment)


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [pytest.param(t, ln, f, id=i) for i, t, ln, f in INJECTION_KVC],
)
def test_kvc_injection_is_refused_and_never_run(
    root: HostRoot, marker: Path, text: str, line: int, fragment: str
) -> None:
    # Through the whole loader, from a real file, as the daemon would read it.
    conf = write(root.kvc_conf("simple-kmod"), text.replace("{marker}", str(marker)))
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "simple-kmod")
    _expect(caught.value, conf, line, fragment.replace("{marker}", str(marker)))
    assert not marker.exists()
    assert not Path(f"{marker}.sh").exists()


def test_bad_instance_name_kvc() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_kvc_conf("../x", SRC, KVC_SIMPLE)
    assert "bad instance name '../x'" in caught.value.detail


# --- through the loader: lib.sh and file safety --------------------------------------------


def test_load_kvc_instance_with_lib(root: HostRoot) -> None:
    conf = write(root.kvc_conf("simple-kmod"), KVC_SIMPLE)
    etc_lib, usr_lib, local_lib = root.kvc_libs("simple-kmod")
    write(usr_lib, "build_kmods() { :; }\n", 0o755)
    write(local_lib, "", 0o755)
    config = load_instance(root, "simple-kmod")
    assert (config.source, config.format, config.kvc_lib) == (conf, "kvc", usr_lib)
    write(etc_lib, "", 0o644)
    assert load_instance(root, "simple-kmod").kvc_lib == etc_lib


def test_load_kvc_instance_without_lib(root: HostRoot) -> None:
    write(root.kvc_conf("simple-kmod"), KVC_SIMPLE)
    assert load_instance(root, "simple-kmod").kvc_lib is None


@pytest.mark.parametrize(("mode", "shown"), [(0o775, "0775"), (0o757, "0757"), (0o666, "0666")])
def test_writable_lib_refused(root: HostRoot, mode: int, shown: str) -> None:
    write(root.kvc_conf("simple-kmod"), KVC_SIMPLE)
    lib = write(root.kvc_libs("simple-kmod")[1], "", mode)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "simple-kmod")
    assert caught.value.path == lib
    assert caught.value.detail == (
        f"refusing: writable by group/others (mode {shown}); it decides what runs in the kernel"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_lib_owned_by_another_uid_refused(root: HostRoot) -> None:
    write(root.kvc_conf("simple-kmod"), KVC_SIMPLE)
    lib = write(root.kvc_libs("simple-kmod")[0], "", 0o755)
    os.chown(lib, NOBODY, -1)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "simple-kmod")
    assert caught.value.path == lib
    assert f"refusing: owned by uid {NOBODY}" in caught.value.detail


def test_group_writable_conf_refused(root: HostRoot) -> None:
    conf = write(root.kvc_conf("simple-kmod"), KVC_SIMPLE, 0o664)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "simple-kmod")
    assert caught.value.path == conf
    assert "refusing: writable by group/others (mode 0664)" in caught.value.detail


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_conf_owned_by_another_uid_refused(root: HostRoot) -> None:
    conf = write(root.kvc_conf("simple-kmod"), KVC_SIMPLE)
    os.chown(conf, NOBODY, -1)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "simple-kmod")
    assert f"refusing: owned by uid {NOBODY}, not by root" in caught.value.detail


def test_lib_in_world_writable_dir_refused(root: HostRoot) -> None:
    write(root.kvc_conf("simple-kmod"), KVC_SIMPLE)
    lib = write(root.kvc_libs("simple-kmod")[2], "", 0o755)
    lib.parent.chmod(0o777)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "simple-kmod")
    assert "is writable by others without the sticky bit (mode 0777)" in caught.value.detail


@pytest.mark.parametrize(
    "context",
    [
        "git://github.com/kmods-via-containers/kvc-simple-kmod.git",  # kvc-simple-kmod's own
        "git+https://github.com/kmods-via-containers/kvc-simple-kmod",
        "https://github.com/kmods-via-containers/kvc-simple-kmod.git",
    ],
)
def test_kvc_git_contexts_are_accepted(context: str) -> None:
    text = doc(*HEAD[:2], f"KMOD_CONTAINER_BUILD_CONTEXT={context}")
    cfg = parse_kvc_conf("simple-kmod", SRC, text)
    assert cfg.build is not None and cfg.build.context == context


# --- KVC's node-wide conf: /etc/kvc/kmods-via-containers.conf ---------------------------------

# What KVC installs (its runtime chooser, as a shell function): kvcd reads it as podman.
KVC_STOCK_GLOBAL = """\
# This configuration file is meant to be used with the
# kmods-via-containers software stack.

# podman     - for day-1 out-of-tree drivers
# kubernetes - for day-2 out-of-tree drivers
get_container_environment() {
        if awk -F/ '$2 == "kubepods.slice"' /proc/self/cgroup | read non_empty_input; then
                echo kubernetes
        else
                echo podman
        fi
}

# The container runtime to use for building/executing containers
KVC_CONTAINER_RUNTIME=$(get_container_environment)
"""


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        (KVC_STOCK_GLOBAL, None, None),
        ("KVC_CONTAINER_RUNTIME=podman\n", None, None),
        ("# nothing set\n", None, None),
        ("KVC_CONTAINER_RUNTIME=docker\n", 1, "KVC_CONTAINER_RUNTIME='docker': kvcd builds"),
        ("\nKVC_CONTAINER_RUNTIME=kubernetes\n", 2, "set KVC_CONTAINER_RUNTIME=podman"),
        ("KVC_CONTAINER_RUNTIME=podman\nKVC_DEBUG=1\n", 2, "'KVC_DEBUG' is not a setting"),
        (
            KVC_STOCK_GLOBAL.replace("echo podman", "echo docker"),
            None,
            "",
        ),  # not the stock function: code kvcd will not run
        ("KVC_CONTAINER_RUNTIME=$(which podman)\n", 1, ""),
    ],
    ids=[
        "stock",
        "podman",
        "empty",
        "docker",
        "kubernetes",
        "unknown-var",
        "edited-function",
        "command",
    ],
)
def test_kvc_global_conf_is_podman_or_refused(
    text: str, line: int | None, fragment: str | None
) -> None:
    path = "/etc/kvc/kmods-via-containers.conf"
    if fragment is None:
        assert check_kvc_global(path, text) == "podman"
        return
    with pytest.raises(ConfigError) as err:
        check_kvc_global(path, text)
    assert str(err.value).startswith(path)
    assert fragment in str(err.value)
    if line is not None:
        assert err.value.line == line


def test_kvc_global_conf_is_never_an_instance(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    """KVC installs it on every node: `kvcd check-config --all` passes, `kvcd status` shows no
    phantom instance, and the name is refused as an instance name."""
    fakehost.write(root.kvc_conf("kmods-via-containers"), KVC_STOCK_GLOBAL)
    fakehost.write(root.kvc_conf("simple-kmod"), KVC_SIMPLE)
    assert list_instances(root) == ["simple-kmod"]
    assert cli.main(["--root", str(root.root), "check-config", "--all"]) == 0
    out = capsys.readouterr().out
    assert "kmods-via-containers.conf: ok (KVC's node-wide conf" in out
    assert "simple-kmod: ok" in out
    assert cli.main(["--root", str(root.root), "status"]) == 0
    assert "kmods-via-containers" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="is not an instance name"):
        load_instance(root, "kmods-via-containers")


def test_a_kvc_global_conf_kvcd_cannot_honor_fails_check_config_and_start(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    fakehost.write(root.kvc_conf("kmods-via-containers"), "KVC_CONTAINER_RUNTIME=docker\n")
    fakehost.write(root.kvc_conf("simple-kmod"), KVC_SIMPLE)
    assert cli.main(["--root", str(root.root), "check-config", "--all"]) == 2
    err = capsys.readouterr().err
    assert "kmods-via-containers.conf:1: KVC_CONTAINER_RUNTIME='docker'" in err
    with pytest.raises(ConfigError):
        load_settings(root)  # what `kvcd run` reads first: the start fails the same way
