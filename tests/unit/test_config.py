"""Native TOML instance files, node settings, file safety and where instances are found."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcd.config.loader import (
    list_instances,
    load_instance,
    load_settings,
    parse_instance_toml,
    parse_settings_toml,
)
from kvcd.config.model import BuildSource, ConfigError, InstanceConfig, ModuleSpec, Settings
from kvcd.config.tomlsrc import KeyLines, decode
from kvcd.host.paths import HostRoot
from tests.fakehost import doc, write

REPO = Path(__file__).resolve().parents[2]
SRC = Path("/etc/kvcd/instances/foo.toml")
NOBODY = 65534


# A valid start for rows that only break one thing further down (lines 1-3).
HEAD = ('version = "1.0"', 'modules = ["kvcd_base", "kvcd_user"]', 'image = "reg.example/foo:x"')


# --- good configs --------------------------------------------------------------------------

FULL = doc(
    'version = "1.0"',
    'modules = ["kvcd_base", "kvcd-user"]',
    'image = "registry.example.com/drv/foo:{version}-{kernel}"',
    'modules_path = "/opt/mods/{kernel}/"',
    'unload_policy = "never"',
    "keep_images = 5",
    'wrapper_args = ["--privileged", "-v", "/dev:/dev"]',
    "[build]",
    'context = "https://git.example.com/drv/foo.git"',
    'containerfile = "build/Containerfile.rhel"',
    "[build.args]",
    'FOO = "bar"',
    'GIT_REF = "v1.0"',
    "[params.kvcd_user]",
    'greeting = "hello"',
    "count = 3",
    "debug = true",
    "quiet = false",
    "[params.kvcd_base]",
    'mode = "fast"',
)

FULL_EXPECTED = InstanceConfig(
    name="foo",
    source=SRC,
    version="1.0",
    modules=(
        ModuleSpec("kvcd_base", (("mode", "fast"),)),
        ModuleSpec(
            "kvcd-user", (("greeting", "hello"), ("count", "3"), ("debug", "1"), ("quiet", "0"))
        ),
    ),
    build=BuildSource(
        context="https://git.example.com/drv/foo.git",
        containerfile="build/Containerfile.rhel",
        args=(("FOO", "bar"), ("GIT_REF", "v1.0")),
    ),
    image="registry.example.com/drv/foo:{version}-{kernel}",
    modules_path="/opt/mods/{kernel}/",
    unload_policy="never",
    keep_images=5,
    wrapper_args=("--privileged", "-v", "/dev:/dev"),
    kvc_lib=None,
    kvc_env=(),
    format="toml",
)


def test_full_config_parses_to_exact_instance() -> None:
    assert parse_instance_toml("foo", SRC, FULL) == FULL_EXPECTED


def test_minimal_config_takes_defaults() -> None:
    text = doc('version = "2"', 'modules = ["m"]', "[build]", 'context = "/usr/share/foo"')
    assert parse_instance_toml("foo", SRC, text) == InstanceConfig(
        name="foo",
        source=SRC,
        version="2",
        modules=(ModuleSpec("m"),),
        build=BuildSource(context="/usr/share/foo", containerfile="Containerfile", args=()),
    )


@pytest.mark.parametrize(
    ("line", "policy"),
    [
        (None, "if-idle"),
        ('unload_policy = "if-idle"', "if-idle"),
        ('unload_policy = "never"', "never"),
        ('unload_policy = "drain"', "drain"),
        # The older spelling, as configs written for earlier releases have it.
        ("unload_on_stop = true", "if-idle"),
        ("unload_on_stop = false", "never"),
    ],
)
def test_unload_policy_and_its_older_spelling(line: str | None, policy: str) -> None:
    text = doc(*HEAD, *([line] if line else []))
    assert parse_instance_toml("foo", SRC, text).unload_policy == policy


def test_image_only_dotted_and_inline_tables() -> None:
    text = doc(
        'version = "1.0"',
        'modules = ["a", "b"]',
        'build.context = "/srv/ctx.tar.gz"',
        'params = { b = { x = "1" } }',
    )
    config = parse_instance_toml("foo", SRC, text)
    assert config.build == BuildSource("/srv/ctx.tar.gz")
    assert config.modules == (ModuleSpec("a"), ModuleSpec("b", (("x", "1"),)))
    image_only = doc('version = "1"', 'modules = ["a"]', 'image = "quay.io/x/y:{kernel}"')
    assert parse_instance_toml("foo", SRC, image_only).build is None


def test_shipped_example_instance_parses() -> None:
    path = REPO / "config" / "example-instance.toml"
    config = parse_instance_toml("example", path, path.read_text())
    assert config.version == "1.0"
    assert [m.name for m in config.modules] == ["kvcd_base", "kvcd_user"]
    assert config.build is not None and config.image is not None
    assert dict(config.modules[1].params)["verbose"] == "0"


def test_shipped_settings_file_parses() -> None:
    path = REPO / "config" / "kvcd.toml"
    assert parse_settings_toml(path, path.read_text()) == Settings()


def test_build_arg_values_are_inert_data(marker: Path) -> None:
    # A build argument is handed to podman as one argv element; no shell ever sees it.
    text = doc(*HEAD, "[build]", 'context = "/x"', "[build.args]", f'X = "$(touch {marker})"')
    config = parse_instance_toml("foo", SRC, text)
    assert config.build is not None
    assert config.build.args == (("X", f"$(touch {marker})"),)
    assert not marker.exists()


# --- bad configs: (id, text, line, exact message fragment) ----------------------------------

BAD_TOML = [
    # A key of many dotted parts costs tomllib quadratic time (120 KB took 100 s of CPU): it is
    # refused before tomllib reads it, in a table header, a dotted key or an inline table.
    ("deep-dotted-key", doc(*HEAD, "a." * 5000 + "b = 1"), 4, "a key of more than 32 dotted"),
    ("deep-header", doc(*HEAD, "[" + "t." * 40 + "x]"), 4, "a key of more than 32 dotted"),
    ("deep-quoted-key", doc(*HEAD, '"q".' * 40 + "x = 1"), 4, "a key of more than 32 dotted"),
    ("deep-inline", doc(*HEAD, "x = { " + "a." * 40 + "b = 1 }"), 4, "a key of more than 32"),
    # A multi-line string may end in up to five quotes: the scan is not put out of step.
    ("deep-after-4-quotes", doc(*HEAD, 'd = """x""""', "a." * 40 + "b = 1"), 5, "more than 32"),
    ("deep-after-5-quotes", doc(*HEAD, "d = '''x'''''", "a." * 40 + "b = 1"), 5, "more than 32"),
    # Settings that would do nothing without another are refused, not ignored.
    (
        "tls-verify-without-image",
        doc(
            'version = "1.0"', 'modules = ["a"]', "tls_verify = false", "[build]", 'context = "/x"'
        ),
        3,
        "'tls_verify' applies to pulling 'image': set 'image'",
    ),
    (
        "upgrade-label-without-ordered-upgrade",
        doc(*HEAD, 'upgrade_label = "example.com/v"'),
        4,
        "'upgrade_label' needs 'ordered_upgrade = true'",
    ),
    (
        "upgrade-label-with-ordered-upgrade-false",
        doc(*HEAD, "ordered_upgrade = false", 'upgrade_label = "example.com/v"'),
        5,
        "'upgrade_label' needs 'ordered_upgrade = true'",
    ),
    (
        "unknown-key-suggests",
        doc('version = "1.0"', 'modlues = ["a"]', 'image = "r/x"'),
        2,
        "unknown key 'modlues' in [top level] (did you mean 'modules'?)",
    ),
    (
        "unknown-key-no-suggestion",
        doc(*HEAD, "zzz = 1"),
        4,
        "unknown key 'zzz' in [top level]",
    ),
    (
        "unknown-key-in-build",
        doc(*HEAD, "[build]", 'context = "/x"', 'containerfle = "C"'),
        6,
        "unknown key 'containerfle' in [build] (did you mean 'containerfile'?)",
    ),
    (
        "unknown-key-in-inline-build",
        doc(*HEAD, 'build = { context = "/x", contxt = "y" }'),
        4,
        "unknown key 'contxt' in [build] (did you mean 'context'?)",
    ),
    (
        "keep-images-string",
        doc(*HEAD, 'keep_images = "three"'),
        4,
        "'keep_images' must be an integer from 1 to 100, got \"three\"",
    ),
    (
        "keep-images-zero",
        doc(*HEAD, "keep_images = 0"),
        4,
        "'keep_images' must be an integer from 1 to 100, got 0",
    ),
    (
        "keep-images-bool",
        doc(*HEAD, "keep_images = true"),
        4,
        "'keep_images' must be an integer from 1 to 100, got true",
    ),
    (
        "keep-images-absurd",
        doc(*HEAD, "keep_images = 100000"),
        4,
        "'keep_images' must be an integer from 1 to 100, got 100000",
    ),
    (
        "too-many-modules",
        doc('version = "1.0"', "modules = [" + ", ".join(f'"m{i}"' for i in range(1001)) + "]"),
        2,
        "'modules' lists 1001 modules; at most 1000",
    ),
    (
        "huge-param-value",
        doc(*HEAD, "[params.kvcd_user]", f'greeting = "{"x" * 4097}"'),
        5,
        "'params.kvcd_user.greeting' is 4097 characters long; a parameter value may have at most "
        "4096",
    ),
    (
        "unload-policy-unknown",
        doc(*HEAD, 'unload_policy = "always"'),
        4,
        "'unload_policy' must be one of 'if-idle', 'never', 'drain', got \"always\"",
    ),
    (
        "unload-policy-and-older-spelling",
        doc(*HEAD, 'unload_policy = "never"', "unload_on_stop = false"),
        5,
        "'unload_on_stop' is the older spelling of 'unload_policy': set only 'unload_policy'",
    ),
    (
        "unload-on-stop-string",
        doc(*HEAD, 'unload_on_stop = "yes"'),
        4,
        "'unload_on_stop' must be true or false, got \"yes\"",
    ),
    (
        "wrapper-args-not-strings",
        doc(*HEAD, "wrapper_args = [1]"),
        4,
        "'wrapper_args' must be an array of strings, got an array",
    ),
    (
        "missing-version",
        doc('modules = ["a"]', 'image = "r/x"'),
        None,
        "missing required key 'version'",
    ),
    (
        "version-integer",
        doc("version = 1", 'modules = ["a"]'),
        1,
        "'version' must be a non-empty string, got 1",
    ),
    (
        "version-with-space",
        doc('version = "1 0"', 'modules = ["a"]'),
        1,
        "'version' must match [A-Za-z0-9][A-Za-z0-9._+~-]*",
    ),
    (
        "missing-modules",
        doc('version = "1"', 'image = "r/x"'),
        None,
        "missing required key 'modules'",
    ),
    ("empty-modules", doc('version = "1"', "modules = []"), 2, "'modules' must not be empty"),
    (
        "modules-not-array",
        doc('version = "1"', 'modules = "a b"'),
        2,
        "'modules' must be an array of module names, got \"a b\"",
    ),
    (
        "duplicate-modules",
        doc('version = "1"', 'modules = ["kvcd_x", "kvcd-x"]', 'image = "r/x"'),
        2,
        "duplicate module 'kvcd-x' in 'modules' "
        "(same as 'kvcd_x': the kernel treats - and _ alike)",
    ),
    (
        "duplicate-modules-same-spelling",
        doc('version = "1"', 'modules = ["a", "a"]'),
        2,
        "duplicate module 'a' in 'modules'",
    ),
    (
        "module-name-space",
        doc('version = "1"', 'modules = ["kvcd x"]'),
        2,
        "'modules' entry \"kvcd x\" is not a module name",
    ),
    (
        "module-name-option",
        doc('version = "1"', 'modules = ["-v"]'),
        2,
        "'modules' entry \"-v\" is not a module name",
    ),
    (
        "no-build-no-image",
        doc('version = "1"', 'modules = ["a"]'),
        None,
        "needs a [build] table, an 'image' (or both), or an 'image_archive'",
    ),
    (
        "archive-relative",
        doc('version = "1"', 'modules = ["a"]', 'image_archive = "drv.tar"'),
        3,
        "'image_archive' must be an absolute file path, got \"drv.tar\"",
    ),
    (
        "archive-dotdot",
        doc('version = "1"', 'modules = ["a"]', 'image_archive = "/srv/../etc/x.tar"'),
        3,
        "'image_archive' must be a normalized path (no '.' or '..')",
    ),
    (
        "archive-directory",
        doc('version = "1"', 'modules = ["a"]', 'image_archive = "/srv/drivers/"'),
        3,
        "'image_archive' must be an absolute file path",
    ),
    (
        "archive-evil-placeholder",
        doc('version = "1"', 'modules = ["a"]', 'image_archive = "/srv/{name}.tar"'),
        3,
        "unknown placeholder '{name}' in 'image_archive' (only {kernel} and {version})",
    ),
    (
        "archive-and-image",
        doc(
            'version = "1"', 'modules = ["a"]', 'image = "reg/x:1"', 'image_archive = "/srv/x.tar"'
        ),
        4,
        "'image_archive' pins the instance to an archive on the node, which is never pulled or "
        "built: remove 'image'",
    ),
    (
        "archive-and-build",
        doc(
            'version = "1"',
            'modules = ["a"]',
            'image_archive = "/srv/x.tar"',
            "[build]",
            'context = "/srv/ctx"',
        ),
        3,
        "remove 'build'",
    ),
    (
        "image-evil-placeholder",
        doc('version = "1"', 'modules = ["a"]', 'image = "reg/x:{evil}"'),
        3,
        "unknown placeholder '{evil}' in 'image' (only {kernel} and {version})",
    ),
    (
        "image-unbalanced-brace",
        doc('version = "1"', 'modules = ["a"]', 'image = "reg/x:{kernel"'),
        3,
        "'image' has an unmatched '{' or '}'",
    ),
    (
        "image-with-space",
        doc('version = "1"', 'modules = ["a"]', 'image = "reg/x --privileged"'),
        3,
        "'image' is not an image reference",
    ),
    (
        "modules-path-version-placeholder",
        doc(*HEAD, 'modules_path = "/lib/modules/{version}"'),
        4,
        "unknown placeholder '{version}' in 'modules_path' (only {kernel})",
    ),
    (
        "modules-path-relative",
        doc(*HEAD, 'modules_path = "lib/modules/{kernel}"'),
        4,
        "'modules_path' must be an absolute path",
    ),
    ("build-not-table", doc(*HEAD, 'build = "/x"'), 4, "'build' must be a table, got \"/x\""),
    (
        "build-missing-context",
        doc(*HEAD, "[build]", 'containerfile = "C"'),
        4,
        "missing required key 'context' in [build]",
    ),
    (
        "relative-context",
        doc(*HEAD, "[build]", 'context = "src/foo"'),
        5,
        "'build.context' must be an absolute path (a directory or a tarball) or a URL",
    ),
    (
        "http-context",
        doc(*HEAD, "[build]", 'context = "http://example.com/x.git"'),
        5,
        "'build.context': http:// is not a build context kvcd can use; use https://, git://, "
        "git+https:// or an absolute path",
    ),
    (
        "password-in-context",
        doc(*HEAD, "[build]", 'context = "https://bob:hunter2@git.example.com/x.git"'),
        5,
        "must not carry a password in the URL",
    ),
    (
        "git-context-without-repository",
        doc(*HEAD, "[build]", 'context = "git://example.com/"'),
        5,
        "names no repository",
    ),
    (
        "containerfile-dotdot",
        doc(*HEAD, "[build]", 'context = "/x"', 'containerfile = "../../etc/Containerfile"'),
        6,
        "'build.containerfile' must be a relative path inside the build context, without '..'",
    ),
    (
        "containerfile-absolute",
        doc(*HEAD, 'build.context = "/x"', 'build.containerfile = "/etc/C"'),
        5,
        "'build.containerfile' must be a relative path",
    ),
    (
        "build-arg-kver",
        doc(*HEAD, "[build]", 'context = "/x"', "[build.args]", 'KVER = "6.0"'),
        7,
        "'build.args.KVER' is reserved",
    ),
    (
        "build-arg-kmodver-dotted",
        doc(*HEAD, "[build]", 'context = "/x"', 'args.KMODVER = "1"'),
        6,
        "'build.args.KMODVER' is reserved",
    ),
    (
        "build-arg-bad-name",
        doc(*HEAD, "[build]", 'context = "/x"', "[build.args]", '"1X" = "y"'),
        7,
        "bad build argument name '1X' in [build.args]",
    ),
    (
        "build-arg-not-string",
        doc(*HEAD, "[build]", 'context = "/x"', "[build.args]", "N = 1"),
        7,
        "'build.args.N' must be a string, got 1",
    ),
    (
        "params-unlisted-module",
        doc(*HEAD, "[params.kvcd_other]", "a = 1"),
        4,
        "[params.kvcd_other]: module 'kvcd_other' is not in 'modules'",
    ),
    ("params-not-table", doc(*HEAD, "params = 3"), 4, "'params' must be a table, got 3"),
    (
        "param-value-space",
        doc(*HEAD, "[params.kvcd_user]", 'greeting = "hello world"'),
        5,
        "'params.kvcd_user.greeting' must not contain whitespace",
    ),
    (
        "param-value-newline",
        doc(*HEAD, "[params.kvcd_user]", 'greeting = "hello\\nevil=1"'),
        5,
        "'params.kvcd_user.greeting' must not contain a newline or NUL, got \"hello\\nevil=1\"",
    ),
    (
        "param-value-quote",
        doc(*HEAD, "[params.kvcd_user]", "greeting = 'a\"b'"),
        5,
        "must not contain whitespace, double quotes or control characters",
    ),
    (
        "param-value-float",
        doc(*HEAD, "[params.kvcd_user]", "ratio = 1.5"),
        5,
        "'params.kvcd_user.ratio' must be a string, integer or boolean, got 1.5",
    ),
    (
        "param-name-dash",
        doc(*HEAD, "[params.kvcd_user]", '"a-b" = 1'),
        5,
        "bad parameter name 'a-b' in [params.kvcd_user]",
    ),
    (
        "param-inline-table-space",
        doc(*HEAD, 'params = { kvcd_user = { greeting = "a b" } }'),
        4,
        "'params.kvcd_user.greeting' must not contain whitespace",
    ),
    (
        "toml-syntax-unterminated",
        doc(*HEAD, 'keep_images = "3'),
        4,
        "TOML syntax error:",
    ),
    (
        "toml-syntax-duplicate-table",
        doc(*HEAD, "[build]", 'context = "/x"', "[build]"),
        6,
        "TOML syntax error: Cannot declare ('build',) twice",
    ),
]

# Rows that carry a command: the marker must never appear.
INJECTION_TOML = [
    (
        "param-command-substitution",
        doc(*HEAD, "[params.kvcd_user]", 'greeting = "$(touch {marker})"'),
        5,
        "'params.kvcd_user.greeting' must not contain whitespace",
    ),
    (
        "param-semicolon-rm",
        doc(*HEAD, "[params.kvcd_user]", 'greeting = "x;rm -rf / ;touch {marker}"'),
        5,
        "must not contain whitespace",
    ),
    (
        "param-newline-injection",
        doc(*HEAD, "[params.kvcd_user]", 'greeting = """x\ninstall kvcd_user touch {marker}"""'),
        5,
        "must not contain a newline or NUL",
    ),
    (
        "image-evil-placeholder-injection",
        doc(*HEAD[:2], 'image = "r/x:{evil}$(touch {marker})"'),
        3,
        "unknown placeholder '{evil}' in 'image'",
    ),
    (
        "wrapper-args-nul",
        doc(*HEAD, 'wrapper_args = ["a\\u0000; touch {marker}"]'),
        4,
        "'wrapper_args' entries must not contain NUL",
    ),
]


def _expect(exc: ConfigError, path: Path, line: int | None, fragment: str) -> None:
    assert exc.path == path
    assert exc.line == line
    assert fragment in exc.detail
    where = f"{path}:{line}: " if line else f"{path}: "
    assert str(exc).startswith(where)


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [pytest.param(t, ln, f, id=i) for i, t, ln, f in BAD_TOML],
)
def test_bad_toml(text: str, line: int | None, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_instance_toml("foo", SRC, text)
    _expect(caught.value, SRC, line, fragment)


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [pytest.param(t, ln, f, id=i) for i, t, ln, f in INJECTION_TOML],
)
def test_toml_injection_is_refused_and_never_run(
    text: str, line: int, fragment: str, marker: Path
) -> None:
    source = text.replace("{marker}", str(marker))
    with pytest.raises(ConfigError) as caught:
        parse_instance_toml("foo", SRC, source)
    _expect(caught.value, SRC, line, fragment)
    assert not marker.exists()


def test_dots_in_strings_comments_and_numbers_are_no_key_parts() -> None:
    """Only a key's dots count: a value, a comment, a float array may hold any number."""
    dotted = "a." * 100
    text = doc(
        f'modules = ["a"]  # {dotted}',
        f"# {dotted}",
        f'basic = "r/{dotted}x"',
        f"literal = '{dotted}'",
        f'escaped = "\\"{dotted}\\\\"',
        f'multi = """\n{dotted}\n"""',
        'quoted = """He said "hi""""',
        f'after = "{dotted}"',
        "floats = [" + ", ".join(["1.5"] * 100) + "]",
        "[t.u]",
        "v = 1",
    )
    got = decode(SRC, text)
    assert got["basic"] == f"r/{dotted}x" and got["escaped"] == f'"{dotted}\\'
    assert got["multi"] == f"{dotted}\n" and len(got["floats"]) == 100


@pytest.mark.parametrize(
    "name", ["", "../etc/passwd", "a/b", "-x", ".hidden", "a b", "x" * 129, "ü", "a\nb"]
)
def test_bad_instance_name(name: str) -> None:
    text = doc('version = "1"', 'modules = ["a"]', 'image = "r/x"')
    with pytest.raises(ConfigError) as caught:
        parse_instance_toml(name, SRC, text)
    assert f"bad instance name {name!r}" in caught.value.detail


@pytest.mark.parametrize("name", ["a", "nvidia-gpu", "x.y_z-1", "A" * 128])
def test_good_instance_names(name: str) -> None:
    text = doc('version = "1"', 'modules = ["a"]', 'image = "r/x"')
    assert parse_instance_toml(name, SRC, text).name == name


@pytest.mark.parametrize("name", ["a@b", "kvcd@x", "x.y_z@1", "-x", ".x", "a/b", ""])
def test_bad_instance_names(name: str) -> None:
    """'@' would make kvcd@a@b.service, which systemd refuses: refused first, by name."""
    text = doc('version = "1"', 'modules = ["a"]', 'image = "r/x"')
    with pytest.raises(ConfigError, match="bad instance name"):
        parse_instance_toml(name, SRC, text)


def test_key_lines_locator() -> None:
    text = doc(
        'version = "1"',  # 1
        'desc = """',  # 2
        "[not_a_table]",  # 3
        'fake = 1"""',  # 4
        "modules = [",  # 5
        '  "a",  # comment',  # 6
        "]",  # 7
        'build.context = "/x"',  # 8
        "[build.args]",  # 9
        "'quoted.key' = 'v'",  # 10
        "[params]",  # 11
        "a = { b = 1, c = { d = 2 } }",  # 12
        "[[arr]]",  # 13
        "k = 1",  # 14
    )
    lines = KeyLines(text)
    assert lines.line("version") == 1
    assert lines.line("desc") == 2
    assert lines.line("not_a_table") is None
    assert lines.line("fake") is None
    assert lines.line("modules") == 5
    assert lines.line("build") == 8
    assert lines.line("build", "context") == 8
    assert lines.line("build", "args") == 9
    assert lines.line("build", "args", "quoted.key") == 10
    assert lines.line("params", "a", "c", "d") == 12
    assert lines.line("arr") == 13
    assert lines.line("arr", "k") is None
    assert lines.line("nowhere") is None


# --- where instances are found -------------------------------------------------------------

SIMPLE = doc('version = "{v}"', 'modules = ["m"]', 'image = "r/x:{{kernel}}"')


def test_admin_wins_over_vendor_whole(root: HostRoot) -> None:
    admin, vendor = root.instance_dirs()
    write(vendor / "foo.toml", SIMPLE.format(v="vendor") + "keep_images = 9\n")
    write(admin / "foo.toml", SIMPLE.format(v="admin"))
    config = load_instance(root, "foo")
    assert config.version == "admin"
    assert config.source == admin / "foo.toml"
    assert config.keep_images == 3  # no merging with the vendor file


def test_vendor_used_without_admin(root: HostRoot) -> None:
    _, vendor = root.instance_dirs()
    write(vendor / "foo.toml", SIMPLE.format(v="vendor"))
    assert load_instance(root, "foo").source == vendor / "foo.toml"


def test_native_wins_over_kvc(root: HostRoot) -> None:
    _, vendor = root.instance_dirs()
    write(vendor / "foo.toml", SIMPLE.format(v="native"))
    write(root.kvc_conf("foo"), "KMOD_SOFTWARE_VERSION=kvc\n")
    config = load_instance(root, "foo")
    assert (config.version, config.format) == ("native", "toml")


def test_missing_instance_names_every_place(root: HostRoot) -> None:
    admin, vendor = root.instance_dirs()
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "foo")
    message = str(caught.value)
    assert "no configuration for instance 'foo'" in message
    for place in (admin / "foo.toml", vendor / "foo.toml", root.kvc_conf("foo")):
        assert str(place) in message


def test_load_instance_rejects_path_traversal_name(root: HostRoot) -> None:
    admin, _ = root.instance_dirs()
    write(admin.parent / "evil.toml", SIMPLE.format(v="1"))
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "../evil")
    assert "bad instance name '../evil'" in caught.value.detail


def test_list_instances_is_sorted_union(root: HostRoot) -> None:
    admin, vendor = root.instance_dirs()
    write(admin / "b.toml", "")
    write(admin / "shared.toml", "")
    write(vendor / "shared.toml", "")
    write(vendor / "a.toml", "")
    write(vendor / "notes.txt", "")
    write(root.kvc_conf("c"), "")
    write(root.kvc_conf("c").parent / "bad name.conf", "")
    (admin / "dir.toml").mkdir()
    assert list_instances(root) == ["a", "b", "c", "shared"]


def test_an_ignored_file_is_said_once_on_one_line_with_its_name_escaped(
    root: HostRoot, caplog: pytest.LogCaptureFixture
) -> None:
    """A file name is data: its newline cannot start a log line of its own. And a process that
    lists the instances more than once (status, check-config --all) says it once."""
    admin, _vendor = root.instance_dirs()
    write(admin / "n\nl.toml", "")
    write(root.kvc_conf("c").parent / "esc\x1b[2J.conf", "")
    assert list_instances(root) == list_instances(root) == []
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"{admin}/n\\nl.toml: ignored, 'n\\nl' is not a valid instance name",
        f"{root.kvc_conf('c').parent}/esc\\x1b[2J.conf: ignored, 'esc\\x1b[2J' is not a "
        "valid instance name",
    ]


def test_list_instances_empty_host(root: HostRoot) -> None:
    assert list_instances(root) == []


# --- file safety ---------------------------------------------------------------------------

UNSAFE = "; it decides what runs in the kernel"


@pytest.mark.parametrize(
    ("mode", "shown"), [(0o664, "0664"), (0o666, "0666"), (0o646, "0646"), (0o620, "0620")]
)
def test_group_or_other_writable_file_refused(root: HostRoot, mode: int, shown: str) -> None:
    path = write(root.instance_dirs()[0] / "foo.toml", SIMPLE.format(v="1"), mode)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "foo")
    assert caught.value.path == path
    assert caught.value.detail == f"refusing: writable by group/others (mode {shown}){UNSAFE}"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_file_owned_by_another_uid_refused(root: HostRoot) -> None:
    path = write(root.instance_dirs()[0] / "foo.toml", SIMPLE.format(v="1"))
    os.chown(path, NOBODY, -1)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "foo")
    assert caught.value.path == path
    assert f"refusing: owned by uid {NOBODY}, not by root" in caught.value.detail


def test_world_writable_directory_without_sticky_bit_refused(root: HostRoot) -> None:
    admin = root.instance_dirs()[0]
    write(admin / "foo.toml", SIMPLE.format(v="1"))
    admin.chmod(0o777)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "foo")
    assert f"its directory {admin} is writable by others without the sticky bit" in str(
        caught.value
    )
    admin.chmod(0o1777)
    assert load_instance(root, "foo").version == "1"


def test_symlink_target_is_checked(root: HostRoot, tmp_path: Path) -> None:
    admin = root.instance_dirs()[0]
    target = write(tmp_path / "elsewhere" / "real.toml", SIMPLE.format(v="linked"))
    admin.mkdir(parents=True)
    (admin / "foo.toml").symlink_to(target)
    assert load_instance(root, "foo").version == "linked"
    target.chmod(0o666)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "foo")
    assert "refusing: writable by group/others (mode 0666)" in caught.value.detail


def test_dangling_symlink_is_an_error_not_a_fallback(root: HostRoot, tmp_path: Path) -> None:
    admin, vendor = root.instance_dirs()
    write(vendor / "foo.toml", SIMPLE.format(v="vendor"))
    admin.mkdir(parents=True)
    (admin / "foo.toml").symlink_to(tmp_path / "missing.toml")
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "foo")
    assert "cannot read: No such file or directory" in caught.value.detail


def test_not_a_regular_file_refused(root: HostRoot) -> None:
    (root.instance_dirs()[0] / "foo.toml").mkdir(parents=True)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "foo")
    assert "refusing: not a regular file" in caught.value.detail


def test_invalid_utf8_names_line(root: HostRoot) -> None:
    path = root.instance_dirs()[0] / "foo.toml"
    path.parent.mkdir(parents=True)
    path.write_bytes(b'version = "1"\nmodules = ["\xff"]\n')
    path.chmod(0o644)
    with pytest.raises(ConfigError) as caught:
        load_instance(root, "foo")
    assert (caught.value.line, caught.value.detail) == (2, "not valid UTF-8")


# --- node settings -------------------------------------------------------------------------


def test_settings_default_without_file(root: HostRoot) -> None:
    assert load_settings(root) == Settings()


def test_settings_admin_then_vendor(root: HostRoot) -> None:
    write(root.vendor / "kvcd.toml", 'annotation_prefix = "vendor.example.com"\n')
    assert load_settings(root).annotation_prefix == "vendor.example.com"
    write(root.main_config, 'podman_socket = "unix:///run/user/0/podman.sock"\n')
    assert load_settings(root) == Settings(podman_socket="unix:///run/user/0/podman.sock")


def test_settings_all_keys(root: HostRoot) -> None:
    text = doc(
        'podman_socket = "tcp://build-host.example.com:8888"',
        'annotation_prefix = "drivers.example.com"',
        'node_backend = "kubernetes"',
        'kubeconfig = "/etc/kvcd/kubeconfig"',
        'node_name = "worker-1"',
    )
    write(root.main_config, text)
    assert load_settings(root) == Settings(
        podman_socket="tcp://build-host.example.com:8888",
        annotation_prefix="drivers.example.com",
        node_backend="kubernetes",
        kubeconfig="/etc/kvcd/kubeconfig",
        node_name="worker-1",
    )


BAD_SETTINGS = [
    (
        "unknown-key",
        doc('podman_socket = "unix:///x"', 'annotaton_prefix = "a.b"'),
        2,
        "unknown key 'annotaton_prefix' in [top level] (did you mean 'annotation_prefix'?)",
    ),
    (
        "prefix-upper-case",
        doc('annotation_prefix = "Kvcd.io"'),
        1,
        "'annotation_prefix' must be a DNS subdomain",
    ),
    ("prefix-slash", doc('annotation_prefix = "kvcd.io/x"'), 1, "must be a DNS subdomain"),
    ("prefix-dash-end", doc('annotation_prefix = "kvcd-.io"'), 1, "must be a DNS subdomain"),
    ("prefix-empty", doc('annotation_prefix = ""'), 1, 'at most 253 in all), got ""'),
    ("prefix-long-label", doc(f'annotation_prefix = "{"a" * 64}.io"'), 1, "DNS subdomain"),
    ("socket-relative", doc('podman_socket = "unix://run/x.sock"'), 1, "'podman_socket' must be"),
    ("socket-not-string", doc("podman_socket = 1"), 1, "'podman_socket' must be a URL string"),
    (
        "socket-ssh",
        doc('podman_socket = "ssh://core@node1/run/podman/podman.sock"'),
        1,
        "'podman_socket' cannot be ssh:// (podman-py's ssh does not check the host's key, and "
        'kvcd@.service hides ~/.ssh): forward it to a unix socket (ssh -L), got "ssh://',
    ),
    (
        "extra-table",  # what older docs said: refused, never read as the file backend
        doc('podman_socket = "unix:///x"', "[extra]", 'node_backend = "kubernetes"'),
        2,
        "[extra] is not a kvcd setting: node_backend, kubeconfig and node_name are top-level keys",
    ),
    ("syntax", doc("podman_socket = "), 1, "TOML syntax error"),
]


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [pytest.param(t, ln, f, id=i) for i, t, ln, f in BAD_SETTINGS],
)
def test_bad_settings(root: HostRoot, text: str, line: int, fragment: str) -> None:
    path = write(root.main_config, text)
    with pytest.raises(ConfigError) as caught:
        load_settings(root)
    _expect(caught.value, path, line, fragment)


def test_unsafe_settings_file_refused(root: HostRoot) -> None:
    write(root.main_config, "", 0o666)
    with pytest.raises(ConfigError) as caught:
        load_settings(root)
    assert "refusing: writable by group/others (mode 0666)" in caught.value.detail


def test_capsconf_keys_are_every_key_capsconf_parse_reads() -> None:
    """native imports capsconf only for a config with one of rules.CAPSCONF_KEYS (issue #20):
    a key capsconf.parse reads and the set lacks would be silently ignored."""
    import inspect
    import re

    from kvcd.config import capsconf, rules

    read = set(re.findall(r'"(\w+)" (?:not )?in data', inspect.getsource(capsconf.parse)))
    assert read == rules.CAPSCONF_KEYS
    assert rules.CAPSCONF_KEYS.issubset(rules.TOP_KEYS)
