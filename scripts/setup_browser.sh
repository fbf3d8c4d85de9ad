#!/usr/bin/env bash
# Headless Chromium for tests/test_browser.py (the HTML leaderboard in a real browser) and for the
# leaderboard screenshot of scripts/reproduce_leaderboard.sh: Debian's `chromium` and `chromium-driver`.
#
# Idempotent: does nothing when both are on PATH. Installs them with apt-get only when running as root
# and apt-get exists; otherwise it says what to install and still exits 0, so it never fails its caller
# (the browser test then skips and says why).
set -u

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  echo "setup_browser: chromium and chromedriver present"
  exit 0
fi
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_browser: chromium/chromedriver missing; as root on Debian: apt-get install chromium chromium-driver" \
       "(tests/test_browser.py skips without them)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >/dev/null; then
  echo "setup_browser: apt-get could not install chromium chromium-driver (offline?); tests/test_browser.py will skip"
  exit 0
fi
echo "setup_browser: installed $(chromium --version 2>/dev/null | head -1)"
exit 0
