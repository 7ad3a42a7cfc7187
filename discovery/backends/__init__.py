"""One module per backend; `pilotfish.discovery.urls` picks one by URL scheme."""
