# Sourced by scripts/test-vulkan after _env.sh: a real Vulkan driver and what llama.cpp's Vulkan build needs.
#
# Mesa's CPU driver (lavapipe, Debian's mesa-vulkan-drivers) is a real Vulkan implementation, so the Vulkan
# backend runs on a machine without a GPU. Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings,
# which the pinned llama.cpp uses; there the headers (only: the Debian 12 loader stays) of Debian 13's
# libvulkan-dev are unpacked into the user cache and VULKAN_SDK points at them, which CMake's FindVulkan and
# `arcsplit llama build --backend vulkan` both read. Nothing is added to the system's apt sources.
VULKAN_PACKAGES=(mesa-vulkan-drivers vulkan-tools libvulkan-dev glslc spirv-headers)
VULKAN_HEADERS_DEB="libvulkan-dev=1.4.309.0-1"   # Debian 13 (trixie)
VULKAN_HEADERS_SHA256="8d329d465e16168afff58b1bd0dd6db46aac2cc3f56054a481b25a04e90b345a"

_vk_missing=()
if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "arcsplit: the Vulkan tier installs Debian packages; on this system install ${VULKAN_PACKAGES[*]} yourself" >&2
else
  for p in "${VULKAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || _vk_missing+=("$p")
  done
fi
if [ "${#_vk_missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "arcsplit: the Vulkan tier needs: sudo apt-get install ${_vk_missing[*]}" >&2
    exit 2
  fi
  echo "arcsplit: apt-get install ${_vk_missing[*]} …" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${_vk_missing[@]}" >/dev/null
fi

if [ -z "${VULKAN_SDK:-}" ] && ! grep -qs '#define VK_EXT_layer_settings 1' /usr/include/vulkan/vulkan_core.h; then
  _vk_sdk="${ARCSPLIT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/arcsplit}/vulkan-headers/${VULKAN_HEADERS_DEB#*=}"
  if [ ! -f "$_vk_sdk/include/vulkan/vulkan_core.h" ]; then
    echo "arcsplit: the system's Vulkan headers are too old; fetching Debian 13's $VULKAN_HEADERS_DEB (headers only) …" >&2
    _vk_tmp="$(mktemp -d)"
    mkdir -p "$_vk_tmp/lists/partial" "$_vk_tmp/cache/archives/partial" "$_vk_tmp/dl"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
      > "$_vk_tmp/sources.list"
    _vk_apt=(-o "Dir::Etc::SourceList=$_vk_tmp/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o "Dir::State::Lists=$_vk_tmp/lists" -o "Dir::Cache=$_vk_tmp/cache"
             -o Dir::Etc::Preferences=/dev/null -o Dir::Etc::PreferencesParts=/dev/null
             -o "APT::Sandbox::User=$(id -un)" -o Debug::NoLocking=1)
    apt-get "${_vk_apt[@]}" update -qq >/dev/null
    (cd "$_vk_tmp/dl" && apt-get "${_vk_apt[@]}" download -qq "$VULKAN_HEADERS_DEB" >/dev/null)
    _vk_deb="$(ls "$_vk_tmp"/dl/*.deb)"
    if [ "$(sha256sum "$_vk_deb" | cut -d' ' -f1)" != "$VULKAN_HEADERS_SHA256" ]; then
      echo "arcsplit: $(basename "$_vk_deb") does not have the expected sha256; not using it" >&2
      rm -rf "$_vk_tmp"
      exit 2
    fi
    dpkg-deb -x "$_vk_deb" "$_vk_tmp/x"
    rm -rf "$_vk_sdk.partial" && mkdir -p "$_vk_sdk.partial"
    mv "$_vk_tmp/x/usr/include" "$_vk_sdk.partial/include"
    rm -rf "$_vk_sdk" && mv "$_vk_sdk.partial" "$_vk_sdk"
    rm -rf "$_vk_tmp"
  fi
  export VULKAN_SDK="$_vk_sdk"
fi
# Lavapipe warns on every start without a runtime dir.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
