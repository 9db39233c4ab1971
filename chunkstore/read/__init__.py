"""Reading: manifest trees, chunks through delta chains and pack members, versions."""
