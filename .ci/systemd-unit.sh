# Checks deploy/wor.service with `systemd-analyze verify`, against the binary just built (the
# unit names /usr/local/bin/wor). Any complaint fails, not only errors. Sourced by .ci/run;
# skipped, saying so, where systemd-analyze is not installed.
if command -v systemd-analyze >/dev/null; then
  unit_dir=$(mktemp -d)
  sed "s|/usr/local/bin/wor|$CARGO_TARGET_DIR/debug/wor|" deploy/wor.service > "$unit_dir/wor.service"
  complaints=$(systemd-analyze verify "$unit_dir/wor.service" 2>&1) || { echo "$complaints"; exit 1; }
  rm -rf "$unit_dir"
  if [ -n "$complaints" ]; then
    echo "$complaints"
    echo "deploy/wor.service: systemd-analyze verify complained"
    exit 1
  fi
  echo "deploy/wor.service verifies"
else
  echo "systemd-analyze is not installed: deploy/wor.service NOT checked"
fi
