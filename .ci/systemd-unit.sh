# Checks the unit template deploy/wor@.service with `systemd-analyze verify`, once for each role
# it is installed as, against the binary just built (the unit names /usr/local/bin/wor). Any
# complaint fails, not only errors. Sourced by .ci/run; skipped, saying so, where
# systemd-analyze is not installed.
if command -v systemd-analyze >/dev/null; then
  unit_dir=$(mktemp -d)
  for role in all api scheduler worker; do
    sed "s|/usr/local/bin/wor|$CARGO_TARGET_DIR/debug/wor|" deploy/wor@.service > "$unit_dir/wor@$role.service"
    complaints=$(systemd-analyze verify "$unit_dir/wor@$role.service" 2>&1) || { echo "$complaints"; exit 1; }
    if [ -n "$complaints" ]; then
      echo "$complaints"
      echo "deploy/wor@.service as wor@$role.service: systemd-analyze verify complained"
      exit 1
    fi
    echo "deploy/wor@.service verifies as wor@$role.service"
  done
  rm -rf "$unit_dir"
else
  echo "systemd-analyze is not installed: deploy/wor@.service NOT checked"
fi
