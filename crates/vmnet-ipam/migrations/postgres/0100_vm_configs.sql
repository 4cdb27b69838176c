-- Desired VM network configs of namespace mode (owned by the agent, vmnet_ipam::vm_store).
-- config: the desired config (JSON text); applied: the last config the kernel layer applied
-- successfully (NULL until one was); last_error: the last apply failure (NULL after a success);
-- updated_at: milliseconds since the Unix epoch of the last change of the row.
-- user_id is unique: every kernel name and the transit /30 derive from it.
CREATE TABLE vm_configs (
    id         TEXT PRIMARY KEY,
    user_id    BIGINT NOT NULL UNIQUE,
    config     TEXT NOT NULL,
    applied    TEXT,
    last_error TEXT,
    updated_at BIGINT NOT NULL
);
