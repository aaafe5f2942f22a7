# Sourced: declares pdcluster's vLLM plugin entry points (pyproject.toml) by a dist-info folder on
# PYTHONPATH, since the repository is not pip-installed on the GPU machine. Without it vLLM loads
# none of our plugins (KV events on the cluster's keys, the compile key), and a host refuses an
# engine with KV events (engine/server_command.py kv_events_plugin_installed).
python3 -c "import sys, tomllib; from pathlib import Path
points = tomllib.loads(Path('pyproject.toml').read_text())['project']['entry-points']
meta = Path(sys.argv[1]) / 'pdcluster_plugins-0.dist-info'; meta.mkdir(parents=True, exist_ok=True)
(meta / 'METADATA').write_text('Metadata-Version: 2.1\nName: pdcluster-plugins\nVersion: 0\n')
(meta / 'entry_points.txt').write_text(''.join(f'[{group}]\n' + ''.join(f'{k} = {v}\n' for k, v in names.items()) for group, names in points.items()))" /tmp/pdc-meta
export PYTHONPATH=$PYTHONPATH:/tmp/pdc-meta
