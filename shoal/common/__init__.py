"""BlueFog's `bluefog.common` package path, so `from bluefog.common import topology_util`
migrates by the same import change as `bluefog.torch` (-> `shoal.common`)."""
