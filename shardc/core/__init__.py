"""The ground floor: the mesh, placements, precision, the options and compile context, the
machine model, errors, and the IR types every layer above shares (``ir.py``). Imports
nothing else of shardc."""
