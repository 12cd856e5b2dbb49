#!/bin/bash
# Runs in the e2e guest at boot (kvcd-e2e-install.service, from the base image): installs this
# run's kvcd wheel, unit files, driver build context and instance config from the payload disk.
set -euo pipefail
P=/mnt/e2e
R=$P/results
mkdir -p "$R"
exec > >(tee -a "$R/install.log") 2>&1
echo "kvcd-e2e install: $(date -u +%FT%TZ) uptime $(cut -d' ' -f1 /proc/uptime)"

shopt -s nullglob
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

mkdir -p /var/lib/kvcd-e2e /etc/kvcd/instances
rm -rf /var/lib/kvcd-e2e/driver
cp -r "$P/driver" /var/lib/kvcd-e2e/driver
install -m 0644 "$P/driver/e2e-kmod.toml" /etc/kvcd/instances/e2e-kmod.toml
systemctl daemon-reload
echo "kvcd-e2e install done: uptime $(cut -d' ' -f1 /proc/uptime)"
