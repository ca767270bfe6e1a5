-- Edit and approve: the arguments an approver corrected a held call to (canonical JSON, pinned
-- ones unchanged). The request's own `arguments` stay as the model proposed them; once edited,
-- `binding_hash` is the edited call's, so only the edited call can use the approval.
ALTER TABLE approvals ADD COLUMN edited_arguments TEXT;
