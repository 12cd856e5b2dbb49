#!/bin/bash
# Runs in the e2e guest at boot (kvcd-e2e-install.service, from the base image): installs this
# run's kvcd, driver build context and instance config from the payload disk. Once per run: a
# later boot of the same run (a reboot scenario) keeps what the scenarios changed.
#
# kvcd comes from the RPMs' payload (payload/install-method = rpm, the default): run-guest.sh
# unpacked the RPMs with rpm2cpio | cpio into payload/rpm/root and listed each package's files
# (payload/rpm/<name>.files.tsv, from the RPM header). This installs exactly those files, as rpm
# would (modes from the header), then runs each package's %post scriptlet with $1 = 1 (first
# install). guest_scenarios.py's test_kvcd_from_rpm_payload checks the result against the
# header's digests. With install-method = wheel: the kvcd wheel, unpacked (the pre-RPM way).
set -euo pipefail
P=/mnt/e2e
R=$P/results
MARK=/var/lib/kvcd-e2e/installed
mkdir -p "$R"
exec > >(tee -a "$R/install.log") 2>&1
echo "kvcd-e2e install: $(date -u +%FT%TZ) uptime $(cut -d' ' -f1 /proc/uptime)"
if [ -f "$MARK" ]; then
    echo "already installed in an earlier boot of this run ($(cat "$MARK")): nothing to do"
    exit 0
fi
method=$(cat "$P/install-method" 2>/dev/null || echo wheel)

shopt -s nullglob
if [ "$method" = rpm ]; then
    # The files of the RPMs' file lists, then each %post with $1 = 1 (rpmpayload.py).
    python3 "$P/guest/rpmpayload.py" install "$P/rpm"
    echo "installed $(cat "$P"/rpm/*.nevra | paste -sd' ') from the RPM payload"
else
    wheels=("$P"/wheels/kvcd-*.whl)
    if [ ${#wheels[@]} -gt 0 ]; then
        # A pure-Python wheel is a zip: unpacking it (and writing its console scripts) takes a
        # second, where `pip install` takes ~30 s under TCG.
        python3 - "${wheels[@]}" <<'PY'
import configparser, pathlib, shutil, sys, zipfile
# Debian: /usr/local/lib/python3.X/dist-packages is on sys.path (where pip would install).
site = pathlib.Path(f"/usr/local/lib/python{sys.version_info[0]}.{sys.version_info[1]}"
                    "/dist-packages")
site.mkdir(parents=True, exist_ok=True)
for whl in sys.argv[1:]:
    with zipfile.ZipFile(whl) as z:
        tops = {n.split("/", 1)[0] for n in z.namelist()}
        for top in tops:
            shutil.rmtree(site / top, ignore_errors=True)
        z.extractall(site)
        ep = next((n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")), None)
        if ep:
            cp = configparser.ConfigParser()
            cp.read_string(z.read(ep).decode())
            for name, ref in (cp["console_scripts"].items() if "console_scripts" in cp else []):
                mod, func = ref.split(":")
                script = pathlib.Path("/usr/local/bin") / name
                script.write_text(f"#!/usr/bin/python3\nimport sys\nfrom {mod} import {func}\n"
                                  f"sys.exit({func}())\n")
                script.chmod(0o755)
    print("unpacked", whl, "into", site)
PY
        # Units may name /usr/bin/kvcd (as an RPM installs it); pip puts it in /usr/local/bin.
        [ -e /usr/bin/kvcd ] || ln -s /usr/local/bin/kvcd /usr/bin/kvcd
        echo "installed ${wheels[*]##*/}"
    else
        echo "no kvcd wheel on the payload disk: kvcd scenarios will fail, smoke still runs"
    fi
    for u in "$P"/units/*; do
        install -m 0644 "$u" "/etc/systemd/system/${u##*/}"
        echo "installed unit ${u##*/}"
    done
    if [ -f "$P/shim/kmods-via-containers" ]; then
        install -m 0755 "$P/shim/kmods-via-containers" /usr/local/bin/kmods-via-containers
    fi
fi

mkdir -p /var/lib/kvcd-e2e /etc/kvcd/instances
rm -rf /var/lib/kvcd-e2e/driver
cp -r "$P/driver" /var/lib/kvcd-e2e/driver
install -m 0644 "$P/driver/e2e-kmod.toml" /etc/kvcd/instances/e2e-kmod.toml
# A guest that does not run the core scenarios (one shard of CI's) builds e2e-kmod from the
# modules run-guest.sh compiled on the host: the in-container compile is core's to prove, and
# costs minutes under TCG at the first start of every other scenario file that uses e2e-kmod.
if [ -s "$P/only" ] && ! tr ' ' '\n' <"$P/only" | grep -qxF core &&
    [ -f "/var/lib/kvcd-e2e/driver/prebuilt/$(uname -r)/1.0/kvcd_user.ko" ]; then
    sed -i 's/^containerfile = "Containerfile"$/containerfile = "Containerfile.prebuilt"/' \
        /etc/kvcd/instances/e2e-kmod.toml
    echo "e2e-kmod builds from the host's prebuilt modules (no core step in this guest)"
fi
systemctl daemon-reload
echo "$method $(date -u +%FT%TZ)" >"$MARK"
echo "kvcd-e2e install done: uptime $(cut -d' ' -f1 /proc/uptime)"
