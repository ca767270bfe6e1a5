#!/usr/bin/env bash
# Installs the reference MCP servers that the wor-tools tests run against and exports where
# they are. Source it before the tests so the export reaches them:
#
#   source .ci/mcp-servers.sh
#
# Installs into "$WOR_NPM_PREFIX" (default "$HOME/.cache/wor-npm"); an install of the pinned
# version already there is reused. Fails loudly when node or npm is missing and cannot be
# installed.

WOR_MCP_EVERYTHING_VERSION="2026.8.31"

wor_install_mcp_servers() {
  local prefix="${WOR_NPM_PREFIX:-$HOME/.cache/wor-npm}"
  local package="@modelcontextprotocol/server-everything"
  local entry="$prefix/node_modules/.bin/mcp-server-everything"
  local manifest="$prefix/node_modules/$package/package.json"

  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "mcp-servers: installing nodejs and npm from Debian packages (the reference MCP servers are npm packages)" >&2
      apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
    fi
  fi
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    echo "mcp-servers: node and npm are needed to run the reference MCP servers" >&2
    return 1
  fi

  local installed=""
  if [ -f "$manifest" ]; then
    installed="$(node -p "require(process.argv[1]).version" "$manifest")"
  fi
  if [ "$installed" != "$WOR_MCP_EVERYTHING_VERSION" ] || [ ! -e "$entry" ]; then
    echo "mcp-servers: installing $package@$WOR_MCP_EVERYTHING_VERSION with npm into $prefix (the reference MCP server the tool tests talk to)" >&2
    npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error \
      "$package@$WOR_MCP_EVERYTHING_VERSION" >&2 || return 1
  fi
  export WOR_MCP_EVERYTHING="$entry"
  echo "mcp-servers: $package@$WOR_MCP_EVERYTHING_VERSION at $WOR_MCP_EVERYTHING" >&2
}

wor_install_mcp_servers
