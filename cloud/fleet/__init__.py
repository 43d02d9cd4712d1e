"""Scale-out: nodes that follow the controller's placement and answer for each other."""
