-- Durable leader-routed messages: a row per message sent with
-- Router.NotifyDurable, deleted once the leader's handler has returned
-- without error. id orders a channel's messages.
--
-- {{message_table}} is replaced by the quoted, schema-qualified table name,
-- {{message_index}} by the quoted name of its (channel, id) index.
CREATE TABLE IF NOT EXISTS {{message_table}} (
    id       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    channel  text        NOT NULL,
    payload  text        NOT NULL,
    attempts integer     NOT NULL DEFAULT 0,
    sent_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS {{message_index}} ON {{message_table}} (channel, id);
