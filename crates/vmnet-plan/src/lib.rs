//! Pure planners and renderers: desired kernel state and guest documents.
