"""Templates: the sandboxed rendering, the checks a template passes before it is saved, its
versions, and the dry run a preview or a diagnosis uses."""
