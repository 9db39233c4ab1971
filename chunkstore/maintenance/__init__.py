"""Operations over the whole store, one verb per module: gc (with mark and repack),
verify, report, rebuild, retention."""
