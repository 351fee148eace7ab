"""The app's routes, one ``APIRouter`` per family (``build_app`` includes them all)."""
